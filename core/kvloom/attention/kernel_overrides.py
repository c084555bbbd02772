"""Environment overrides of a backend's kernel configuration (tiles, warps, stages).

Triton backends keep their launch parameters in a frozen dataclass of int fields and let
users retune them without code through an environment variable holding
``NAME=INT,NAME=INT`` (``none`` for an optional field): ``KVLOOM_TRITON_ATTN_CONFIG``,
``KVLOOM_TRITON_MLA_CONFIG``. One parser, so every backend reads the same syntax and
reports the same errors.
"""

from __future__ import annotations

import dataclasses


def parse_kernel_overrides(text: str, config_cls: type, env_var: str) -> dict[str, int | None]:
    """``"a=1,b=none"`` -> ``{"a": 1, "b": None}`` for fields of the dataclass ``config_cls``;
    a ``ValueError`` naming ``env_var`` for an unknown field or a value that is no integer."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    overrides: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in fields:
            raise ValueError(f"{env_var}: bad entry {item!r}; expected NAME=INT with NAME one of {sorted(fields)}")
        if value.lower() == "none":
            overrides[name] = None
            continue
        try:
            overrides[name] = int(value)
        except ValueError:
            raise ValueError(f"{env_var}: {name}={value!r} is not an integer") from None
    return overrides
