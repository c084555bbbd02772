"""The conformance suite's case catalogue: the scenarios, the GQA layouts, and the cases
each backend runs, derived from what it declares it supports."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention import selector
from kvloom.attention.backend import AttentionBackend, MultipleOf, dtype_name
from kvloom.testing.conformance.mla import mla_conformance_cases

#: What each scenario exercises.
SCENARIOS: dict[str, str] = {
    "kv_write": "new tokens written across block boundaries through the slot mapping, "
    "with -1 padding rows that must not be written",
    "prefill": "prompts without cached context (causal attention among new tokens)",
    "chunked_prefill": "step 1 prefills a prefix through the backend, step 2 attends a chunk "
    "over that cached prefix",
    "decode": "one new token per request over contexts of many blocks",
    "long_decode": "decodes over contexts of thousands of tokens (split-KV paths of GPU kernels)",
    "mixed": "prefill chunks, fresh prompts and decodes in one batch, shuffled order",
    "padded_tokens": "a mixed batch with extra token rows past num_actual_tokens (slot -1)",
    "cudagraph_padding": "a decode batch padded with CUDA-graph filler requests "
    "(query_len 1, seq_len 1, block-table row 0, slot -1)",
    "sliding_window": "a mixed batch with a sliding window shorter than the contexts (not a multiple of the "
    "block size); the blocks before each request's window hold NaN",
    "sliding_window_long_decode": "decodes over thousands of tokens with a sliding window (the positions "
    "before it must be skipped, not only masked)",
    "sinks": "a mixed batch with attention sinks (gpt-oss: a per-head logit in the softmax denominator)",
    "soft_cap": "a mixed batch with logit soft-capping (Gemma 2: cap * tanh(s / cap))",
    "window_sinks": "a mixed batch with a sliding window and attention sinks (gpt-oss's windowed layers)",
}

#: Scenarios of the attention features, and the capability each needs
#: (``AttentionBackend.supports_*``): a backend without it does not run them.
FEATURE_SCENARIOS: dict[str, tuple[str, ...]] = {
    "sliding_window": ("supports_sliding_window",),
    "sliding_window_long_decode": ("supports_sliding_window",),
    "sinks": ("supports_sinks",),
    "soft_cap": ("supports_logits_soft_cap",),
    "window_sinks": ("supports_sliding_window", "supports_sinks"),
}
#: The soft cap of the soft-cap cases: small enough to bend the suite's scores.
SOFT_CAP = 3.0

#: GQA layouts as (num_heads, num_kv_heads); "gqa4" is the base layout of the suite.
HEAD_LAYOUTS: dict[str, tuple[int, int]] = {
    "mha": (4, 4),
    "gqa4": (8, 2),
    "gqa8": (16, 2),
    "mqa": (8, 1),
}
BASE_LAYOUT = "gqa4"


@dataclass(frozen=True)
class ConformanceCase:
    """One configuration to check: a scenario at one dtype / head layout / head size /
    block size. The request lengths and data are drawn when the case runs."""

    scenario: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    #: Softmax scale as a multiple of 1/sqrt(head_size).
    scale_factor: float = 1.0

    @property
    def sliding_window(self) -> int | None:
        """The case's window: two blocks and a bit (75 tokens for blocks of 256 and more)."""
        if self.scenario not in ("sliding_window", "sliding_window_long_decode", "window_sinks"):
            return None
        return 2 * self.block_size + 5 if self.block_size < 256 else 75

    @property
    def sinks(self) -> bool:
        return self.scenario in ("sinks", "window_sinks")

    @property
    def logits_soft_cap(self) -> float | None:
        return SOFT_CAP if self.scenario == "soft_cap" else None

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} unknown (known: {', '.join(SCENARIOS)})")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def with_layout(cls, scenario: str, dtype: torch.dtype, layout: str, head_size: int, block_size: int,
                    scale_factor: float = 1.0) -> "ConformanceCase":
        """A case with one of the named ``HEAD_LAYOUTS`` ("mha", "gqa4", "gqa8", "mqa")."""
        num_heads, num_kv_heads = HEAD_LAYOUTS[layout]
        return cls(scenario, dtype, num_heads, num_kv_heads, head_size, block_size, scale_factor)

    @property
    def scale(self) -> float:
        return self.scale_factor / math.sqrt(self.head_size)

    @property
    def name(self) -> str:
        return (
            f"{self.scenario}[{dtype_name(self.dtype)},h{self.num_heads}/kv{self.num_kv_heads},"
            f"d{self.head_size},bs{self.block_size}]"
        )

    @property
    def params(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "dtype": dtype_name(self.dtype),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
            "scale": self.scale,
            "sliding_window": self.sliding_window,
            "sinks": self.sinks,
            "logits_soft_cap": self.logits_soft_cap,
        }

    def __str__(self) -> str:
        return self.name


def _head_sizes(backend: type[AttentionBackend]) -> list[int]:
    """64/128/256 where supported, plus one size that is not a power of two (the first of
    80, 96, 112, 72, 48 supported, else the first such declared size); when none of
    64/128/256 is supported, the first three declared sizes (or min(64, max_head_size)).
    ``supported_head_sizes=None`` with the default ``max_head_size`` 256: 64, 128, 256, 80."""
    declared = list(backend.supported_head_sizes) if backend.supported_head_sizes is not None else None
    sizes = [h for h in (64, 128, 256) if backend.supports_head_size(h)]
    odd = next((h for h in (80, 96, 112, 72, 48) if backend.supports_head_size(h)), None)
    if odd is None and declared:
        odd = next((h for h in declared if h & (h - 1) and h not in sizes), None)
    if not sizes:
        sizes = declared[:3] if declared else [min(64, backend.max_head_size)]
    if odd is not None and odd not in sizes:
        sizes.append(odd)
    return sizes


def _block_sizes(backend: type[AttentionBackend]) -> list[int]:
    """Exact declared sizes; n and 2n for MultipleOf(n); the preferred size; 256 and 512
    when accepted."""
    sizes: list[int] = []
    for spec in backend.supported_block_sizes:
        sizes += [spec.base, 2 * spec.base] if isinstance(spec, MultipleOf) else [spec]
    sizes.append(backend.preferred_block_size())
    sizes += [b for b in (256, 512) if backend.supports_block_size(b)]
    return list(dict.fromkeys(sizes))


def conformance_cases(
    backend: str | type[AttentionBackend], device: str = "cpu", quick: bool = False
) -> list[ConformanceCase]:
    """The cases the suite runs for ``backend`` (from its declared support).

    Head layouts: ``HEAD_LAYOUTS`` (base ``gqa4``: 8 query heads, 2 KV heads). Head sizes:
    64, 128, 256 where supported plus one that is not a power of two (``_head_sizes``; the
    base is 64 when tested). Block sizes: the declared exact sizes, n and 2n for each
    ``MultipleOf(n)``, the preferred size (the base), 256 and 512 when accepted.

    Full: every scenario at every declared dtype (base layout, head size and block size),
    and for every dtype a mixed batch at each other GQA layout, head size and block size.
    The attention-feature scenarios (``FEATURE_SCENARIOS``: sliding windows, sinks, soft
    caps) run only where the backend declares the feature; the windowed mixed batch also
    at the largest block size.
    An MLA backend gets the MLA cases instead (``kvloom.testing.conformance.mla``).
    Quick: every scenario at the first dtype, a mixed batch at the other dtypes, and one
    case each for the widest GQA ratio, MQA, the odd head size and the largest block size.
    ``device`` is accepted so the signature matches ``run_conformance``; the cases do not
    depend on it (cases a device cannot run are skipped when they run).
    """
    cls = resolve_backend(backend)
    if cls.is_mla:
        return mla_conformance_cases(cls, _block_sizes(cls), quick)  # type: ignore[return-value]
    dtypes = list(cls.supported_dtypes)
    head_sizes = _head_sizes(cls)
    block_sizes = _block_sizes(cls)
    base_head = 64 if 64 in head_sizes else head_sizes[0]
    base_block = cls.preferred_block_size()

    def case(scenario: str, dtype: torch.dtype, layout: str = BASE_LAYOUT, head: int = base_head,
             block: int = base_block) -> ConformanceCase:
        # A non-default softmax scale in the chunked-prefill cases catches backends that
        # ignore ``scale``.
        factor = 1.3 if scenario == "chunked_prefill" else 1.0
        return ConformanceCase.with_layout(scenario, dtype, layout, head, block, factor)

    scenarios = [
        s for s in SCENARIOS if all(getattr(cls, need, False) for need in FEATURE_SCENARIOS.get(s, ()))
    ]
    cases: list[ConformanceCase] = []
    if cls.supports_sliding_window and max(block_sizes) != base_block:
        cases.append(case("sliding_window", dtypes[0], block=max(block_sizes)))
    if quick:
        first = dtypes[0]
        cases += [case(s, first) for s in scenarios]
        cases += [case("mixed", d) for d in dtypes[1:]]
        cases += [case("mixed", first, layout=layout) for layout in ("gqa8", "mqa")]
        odd = [h for h in head_sizes if h & (h - 1)]
        if odd:
            cases.append(case("mixed", first, head=odd[0]))
        if max(block_sizes) != base_block:
            cases.append(case("mixed", first, block=max(block_sizes)))
    else:
        for dtype in dtypes:
            cases += [case(s, dtype) for s in scenarios]
            cases += [case("mixed", dtype, layout=lay) for lay in HEAD_LAYOUTS if lay != BASE_LAYOUT]
            cases += [case("mixed", dtype, head=h) for h in head_sizes if h != base_head]
            cases += [case("mixed", dtype, block=b) for b in block_sizes if b != base_block]
    return list(dict.fromkeys(cases))


def resolve_backend(backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """``backend`` itself, or the backend registered under the NAME ``backend``."""
    if isinstance(backend, str):
        return selector.get_attention_backend(backend)
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend
    raise TypeError(f"backend must be a backend NAME or an AttentionBackend subclass, got {backend!r}")
