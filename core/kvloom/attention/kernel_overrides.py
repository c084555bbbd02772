"""Environment overrides of a backend's kernel configuration (tiles, warps, stages).

Triton backends keep their launch parameters in a frozen dataclass of int fields and let
users retune them without code through an environment variable holding
``NAME=INT,NAME=INT`` (``none`` for an optional field): ``KVLOOM_TRITON_ATTN_CONFIG``,
``KVLOOM_TRITON_MLA_CONFIG``. One parser, so every backend reads the same syntax and
reports the same errors. The rest of the skeleton such a dataclass needs is here too: the
range checks of its fields (``check_launch_fields``), default-then-environment-then-explicit
resolution (``resolve_kernel_config``), ``next_power_of_2``, and ``k_splits``, the split-K
plan of a GEMM whose grid alone would not fill the GPU (decode-sized weight streams).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

C = TypeVar("C")

NUM_WARPS = (1, 2, 4, 8, 16)
MAX_NUM_STAGES = 6


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


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def k_splits(tiles: int, k_tiles: int, device: torch.device, waves: int = 2) -> int:
    """How many programs split the K loop of a GEMM with ``tiles`` output tiles and ``k_tiles``
    K tiles so that the grid covers ``device``'s multiprocessors ``waves`` times (at least 1,
    at most one K tile per split). A device that is not CUDA counts 8 (Triton's interpreter
    running a kernel's CPU tests gets the split plans of a small GPU)."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    return max(1, min(k_tiles, -(-waves * sms // tiles)))


def check_launch_fields(
    config: Any,
    *,
    tiles: Iterable[str] = (),
    tile_sizes: tuple[int, ...] = (16, 32, 64, 128, 256),
    warps: Iterable[str] = (),
    stages: Iterable[str] = (),
    positive: Iterable[str] = (),
) -> None:
    """A ``ValueError`` naming the first field out of range: ``tiles`` in ``tile_sizes``,
    ``warps`` in 1, 2, 4, 8, 16, ``stages`` in 1..6, ``positive`` >= 1 (``None`` allowed
    for the optional ones, e.g. ``force_num_splits``)."""
    for name in tiles:
        if getattr(config, name) not in tile_sizes:
            raise ValueError(f"{name}={getattr(config, name)} must be one of {', '.join(map(str, tile_sizes))}")
    for name in warps:
        if getattr(config, name) not in NUM_WARPS:
            raise ValueError(f"{name}={getattr(config, name)} must be one of {', '.join(map(str, NUM_WARPS))}")
    for name in stages:
        if not 1 <= getattr(config, name) <= MAX_NUM_STAGES:
            raise ValueError(f"{name}={getattr(config, name)} must be in 1..{MAX_NUM_STAGES}")
    for name in positive:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


def resolve_kernel_config(default: C, env_var: str, override: C | dict[str, int | None] | None = None) -> C:
    """``override`` when it is a whole config; else ``default``, then the fields set in
    ``env_var`` (``parse_kernel_overrides``' syntax), then the fields of ``override``."""
    if isinstance(override, type(default)):
        return override
    config = default
    env = os.environ.get(env_var, "")
    if env:
        config = dataclasses.replace(config, **parse_kernel_overrides(env, type(default), env_var))
    if override:
        config = dataclasses.replace(config, **override)
    return config
