"""The logits processors a request asks for (``SamplingParams.extra_args``), checked by the
loaded plugins of the ``kvloom.logits_processors`` group (``kvloom.logits_processor``), and
the instances a model runner applies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvloom.logits_processor import LogitsProcessor


def available_logits_processors() -> dict[str, type[LogitsProcessor]]:
    """Name -> class of every loaded logits processor plugin."""
    from kvloom import plugins

    return plugins.logits_processors()


def parse_extra_args(extra_args: Mapping[str, Any] | None, field: str = "extra_args") -> dict[str, Any]:
    """The processors ``extra_args`` asks for: name -> parsed args (``parse_args``). A bad
    value is a ``ValueError`` ``"{field}.NAME: ..."``; so is a key that names no loaded
    processor (nothing else in kvloom reads ``extra_args``: ignoring it would ignore what
    was asked)."""
    if not extra_args:
        return {}
    processors = available_logits_processors()
    parsed: dict[str, Any] = {}
    for key, value in extra_args.items():
        processor = processors.get(key)
        if processor is None:
            raise ValueError(f"{field}.{key}: no logits processor named {key!r:.60} is loaded (loaded: "
                             f"{', '.join(sorted(processors)) or 'none'}; they come from the kvloom.logits_processors "
                             "entry-point group)")  # fmt: skip
        try:
            parsed[key] = processor.parse_args(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{field}.{key}: {exc}") from None
    return parsed


def make_logits_processors(vocab_size: int, device: torch.device | str) -> dict[str, LogitsProcessor]:
    """An instance of every loaded logits processor, for one model runner."""
    device = torch.device(device)
    return {name: cls(vocab_size, device) for name, cls in available_logits_processors().items()}
