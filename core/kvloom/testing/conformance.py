"""The attention backend conformance suite.

Every attention backend, ours and third parties', proves itself with the same cases: the
KV-cache write through the slot mapping, prefill, chunked prefill over a cached prefix,
decode, mixed batches of prefill chunks and decodes, padded batches, GQA/MQA ratios, and
every dtype, head size and block size the backend declares. Each case runs the backend's
own metadata builder and ``AttentionImpl.forward`` on fresh random paged data and compares

- the attention output of every real token with a float64 reference computed on the CPU
  (relative error ``||out - ref|| / ||ref||`` per request; the case reports the largest),
  after poisoning the output with NaN so that rows the backend never wrote are caught;
- the whole KV cache, read back through ``backend.split_kv_cache``, exactly against the
  expected cache: every real token's K/V at its slot, nothing else changed (slot ``-1``
  rows, the padding, must not be written).

Inputs follow the contract of ``kvloom.attention.backend``: ``query``/``key``/``value`` are
views of one fused QKV tensor (as models pass them), block tables are shuffled and
non-contiguous, block-table entries past a request's last block hold arbitrary *valid*
block ids, cache slots nobody wrote hold large random values (so reading past
``seq_len`` shows), and the softmax scale is not ``1/sqrt(head_size)`` in every case.

Command line (the CLI calls ``run_conformance`` and prints ``report.format()``)::

    kvloom backends test MY_BACKEND [--device cuda] [--quick] [--seed N]

Python::

    from kvloom.testing import run_conformance
    report = run_conformance("MY_BACKEND", device="cuda", quick=True)
    print(report.format())
    assert report.passed

pytest, the recommended pattern for a backend package's own tests (one test per case, so
a failure names its case; the message carries the seed to reproduce it)::

    import pytest
    from kvloom.testing import check_case, conformance_cases
    from my_backend import MyBackend

    @pytest.mark.parametrize("case", conformance_cases(MyBackend, device="cuda"), ids=str)
    def test_conformance(case):
        check_case(MyBackend, case, device="cuda")

Seeds: ``seed=None`` takes ``$KVLOOM_CONFORMANCE_SEED`` when set, else a random seed. Each
case draws its data from (seed, case name), so rerunning one case with the printed seed
reproduces it exactly.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import time
import traceback
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    dtype_name,
)
from kvloom.attention import selector
from kvloom.platforms.interface import DeviceCapability

logger = logging.getLogger(__name__)

#: Largest accepted relative error per model dtype (override with ``tolerances=``).
DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 5e-3,
}

SEED_ENV = "KVLOOM_CONFORMANCE_SEED"

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
}

#: GQA layouts as (num_heads, num_kv_heads); "gqa4" is the base layout of the suite.
HEAD_LAYOUTS: dict[str, tuple[int, int]] = {
    "mha": (4, 4),
    "gqa4": (8, 2),
    "gqa8": (16, 2),
    "mqa": (8, 1),
}
BASE_LAYOUT = "gqa4"


# ---------------------------------------------------------------------------- results
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
        }

    def __str__(self) -> str:
        return self.name


@dataclass
class CaseResult:
    name: str
    params: dict[str, Any]
    rel_error: float | None
    tolerance: float
    passed: bool
    message: str = ""
    skipped: bool = False
    seconds: float = 0.0

    def format(self) -> str:
        if self.skipped:
            return f"SKIP {self.name}: {self.message}"
        err = "n/a" if self.rel_error is None else f"{self.rel_error:.2e}"
        verdict = "PASS" if self.passed else "FAIL"
        line = f"{verdict} {self.name}  rel_err {err} (tol {self.tolerance:.0e}, {self.seconds:.2f}s)"
        return line if self.passed or not self.message else f"{line}\n     {self.message}"


@dataclass
class ConformanceReport:
    backend: str
    device: str
    seed: int
    quick: bool
    cases: list[CaseResult] = field(default_factory=list)
    #: Problems that prevented cases from running at all.
    errors: list[str] = field(default_factory=list)

    @property
    def ran(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.skipped]

    @property
    def failed(self) -> list[CaseResult]:
        return [c for c in self.ran if not c.passed]

    @property
    def passed(self) -> bool:
        """All cases that ran passed, at least one ran, and nothing prevented running."""
        return not self.errors and bool(self.ran) and not self.failed

    def format(self) -> str:
        skipped = len(self.cases) - len(self.ran)
        lines = [
            f"Conformance of {self.backend} on {self.device} ({'quick' if self.quick else 'full'} suite, "
            f"seed {self.seed}): {len(self.ran) - len(self.failed)}/{len(self.ran)} passed"
            + (f", {skipped} skipped" if skipped else "")
        ]
        lines += [f"  ERROR {e}" for e in self.errors]
        lines += [f"  {c.format()}" for c in self.cases]
        if not self.ran and not self.errors:
            lines.append("  ERROR no case ran")
        lines.append(f"{'PASSED' if self.passed else 'FAILED'}")
        if not self.passed:
            lines.append(
                f"reproduce: run_conformance({self.backend!r}, device={self.device!r}, "
                f"quick={self.quick}, seed={self.seed})"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------- case lists
def _head_sizes(backend: type[AttentionBackend]) -> list[int]:
    """64/128/256 where supported, plus one size that is not a power of two."""
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

    Full: every scenario at every declared dtype (base layout, head size and block size),
    and for every dtype a mixed batch at each other GQA layout, head size and block size.
    Quick: every scenario at the first dtype, a mixed batch at the other dtypes, and one
    case each for the widest GQA ratio, MQA, the odd head size and the largest block size.
    ``device`` is accepted so the signature matches ``run_conformance``; the cases do not
    depend on it (cases a device cannot run are skipped when they run).
    """
    cls = resolve_backend(backend)
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

    cases: list[ConformanceCase] = []
    if quick:
        first = dtypes[0]
        cases += [case(s, first) for s in SCENARIOS]
        cases += [case("mixed", d) for d in dtypes[1:]]
        cases += [case("mixed", first, layout=layout) for layout in ("gqa8", "mqa")]
        odd = [h for h in head_sizes if h & (h - 1)]
        if odd:
            cases.append(case("mixed", first, head=odd[0]))
        if max(block_sizes) != base_block:
            cases.append(case("mixed", first, block=max(block_sizes)))
    else:
        for dtype in dtypes:
            cases += [case(s, dtype) for s in SCENARIOS]
            cases += [case("mixed", dtype, layout=lay) for lay in HEAD_LAYOUTS if lay != BASE_LAYOUT]
            cases += [case("mixed", dtype, head=h) for h in head_sizes if h != base_head]
            cases += [case("mixed", dtype, block=b) for b in block_sizes if b != base_block]
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------------- batch plans
@dataclass
class _Request:
    context_len: int  # tokens already in the cache before this step
    query_len: int  # new tokens this step
    blocks: list[int]  # physical blocks, in order, covering the whole sequence

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class _Step:
    requests: list[_Request]
    #: Context already in the cache is written by the suite (True) or was written by the
    #: backend in an earlier step (False).
    prewrite_context: bool = True
    #: Token rows past num_actual_tokens that belong to no request (slot -1).
    padding_tokens: int = 0
    #: CUDA-graph filler requests (query_len 1, seq_len 1, block-table row 0, slot -1).
    filler_requests: int = 0


def _length(rng: random.Random, lo: int, hi: int, block_size: int, *, aligned: bool = False) -> int:
    """A length in [lo, hi]; a multiple of the block size when ``aligned``, otherwise
    (block sizes > 1) not one."""
    if aligned:
        return max(block_size, rng.randint(lo, hi) // block_size * block_size)
    for _ in range(100):
        n = rng.randint(lo, hi)
        if block_size == 1 or n % block_size:
            return n
    return lo if lo % block_size else lo + 1


def _plan(case: ConformanceCase, rng: random.Random) -> tuple[list[_Step], int]:
    """The steps of one case and the number of physical blocks they need (with spares)."""
    bs = case.block_size
    # Lengths scale with the block size so contexts span several blocks. Big blocks
    # (>= 256) get fewer, shorter requests: what matters there is indexing, not length.
    small = bs < 256
    unit = max(bs, 16)
    many = 5 if small else 2
    qmax = 2 * unit if small else 48

    def length(lo: int, hi: int, aligned: bool = False) -> int:
        return _length(rng, lo, hi, bs, aligned=aligned)

    def context() -> int:  # several blocks, ending mid-block
        return length(unit, many * unit)

    def aligned_context() -> int:  # several blocks, ending on a block boundary
        return length(unit, many * unit, aligned=True)

    def crossing_context() -> int:  # ends just before a block boundary, so new tokens cross it
        return bs * rng.randint(1, 2) - rng.randint(1, min(bs, 8)) if bs > 1 else rng.randint(3, 9)

    def query(lo: int = 2) -> int:
        return length(lo, qmax)

    shapes: list[tuple[int, int]]  # (context_len, query_len) for step 1 (or the only step)
    chunks: list[int] = []
    if case.scenario == "prefill":
        shapes = [(0, length(unit + 1, many * unit if small else bs + 40)), (0, query()), (0, query())]
    elif case.scenario == "decode":
        shapes = [(context() - 1, 1), (length(2, unit) - 1, 1), (0, 1), (aligned_context() - 1, 1)]
        if small:
            shapes += [(context() - 1, 1) for _ in range(12)]
    elif case.scenario == "long_decode":
        shapes = [(length(1500, 2500), 1), (length(3000, 4500), 1), (context() - 1, 1)]
    elif case.scenario == "chunked_prefill":
        shapes = [(0, context()), (0, aligned_context()), (0, length(2, unit))]
        chunks = [query(), query(), query(min(unit, qmax))]
    elif case.scenario == "kv_write":
        shapes = [(crossing_context(), length(bs + 2, 2 * bs + 2) if small and bs > 1 else query(9)),
                  (0, query()), (context(), 1), (2 * bs, 1)]
    elif case.scenario in ("mixed", "padded_tokens"):
        shapes = [(context(), query()), (0, query()), (context() - 1, 1), (length(2, unit) - 1, 1),
                  (aligned_context(), query()), (crossing_context(), query(9))]
        if small:
            shapes += [(context() - 1, 1), (0, 1)]
    elif case.scenario == "cudagraph_padding":
        shapes = [(context() - 1, 1) for _ in range(3)] + [(0, 1)]
    else:
        raise ValueError(f"unknown scenario {case.scenario!r} (known: {', '.join(SCENARIOS)})")
    if case.scenario not in ("chunked_prefill",):
        rng.shuffle(shapes)

    total = [c + q + (chunks[i] if chunks else 0) for i, (c, q) in enumerate(shapes)]
    needed = [-(-t // bs) for t in total]
    num_blocks = sum(needed) + 3  # spares: blocks no request owns must stay untouched
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    requests = []
    for (ctx, q), n in zip(shapes, needed):
        requests.append(_Request(ctx, q, physical[:n]))
        physical = physical[n:]

    steps = [_Step(requests)]
    if chunks:
        steps = [
            _Step([_Request(0, r.query_len, r.blocks) for r in requests]),
            _Step([_Request(r.query_len, c, r.blocks) for r, c in zip(requests, chunks)], prewrite_context=False),
        ]
    elif case.scenario == "padded_tokens":
        steps[0].padding_tokens = rng.randint(3, 9)
    elif case.scenario == "kv_write":
        steps[0].padding_tokens = 4
    elif case.scenario == "cudagraph_padding":
        steps[0].filler_requests = 4
    return steps, num_blocks


# ---------------------------------------------------------------------------- running
def resolve_backend(backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    if isinstance(backend, str):
        return selector.get_attention_backend(backend)
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend
    raise TypeError(f"backend must be a backend NAME or an AttentionBackend subclass, got {backend!r}")


def _default_seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    env = os.environ.get(SEED_ENV)
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"{SEED_ENV}={env!r}: expected an integer seed") from None
    return secrets.randbelow(2**31)


def _case_seed(seed: int, case: ConformanceCase) -> int:
    return zlib.crc32(f"{seed}:{case.name}".encode())


def _device_capability(device: torch.device) -> DeviceCapability | None:
    if device.type == "cuda" and torch.cuda.is_available():
        return DeviceCapability(*torch.cuda.get_device_capability(device))
    return None


def _device_problem(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        return f"device {device} is not available in this process"
    return None


class _CaseRunner:
    """Runs one case: builds the batches, calls the backend, checks cache and output."""

    def __init__(self, backend: type[AttentionBackend], case: ConformanceCase, device: torch.device, seed: int) -> None:
        self.backend = backend
        self.case = case
        self.device = device
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.problems: list[str] = []
        self.worst = 0.0
        self.worst_where = ""

    def randn(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        """Random CPU tensor in the case dtype (rounded once, so the reference sees the
        exact values the backend sees)."""
        return (torch.randn(*shape, generator=self.gen) * std).to(self.case.dtype)

    def run(self) -> tuple[float, list[str]]:
        c = self.case
        steps, num_blocks = _plan(c, self.rng)
        shape = self.backend.get_kv_cache_shape(num_blocks, c.block_size, c.num_kv_heads, c.head_size)
        kv_cache = torch.zeros(shape, dtype=c.dtype, device=self.device)
        key_view, value_view = self.backend.split_kv_cache(kv_cache)
        expected_shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_size)
        if tuple(key_view.shape) != expected_shape or tuple(value_view.shape) != expected_shape:
            raise AssertionError(
                f"split_kv_cache gave {tuple(key_view.shape)} / {tuple(value_view.shape)}, "
                f"expected [num_blocks, block_size, num_kv_heads, head_size] = {expected_shape}"
            )
        # Slots no request writes hold large random values: reading them shows.
        self.expected_k = self.randn(*expected_shape, std=4.0)
        self.expected_v = self.randn(*expected_shape, std=4.0)
        key_view.copy_(self.expected_k)
        value_view.copy_(self.expected_v)

        spec = AttentionLayerSpec(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_size,
            dtype=c.dtype,
            kv_cache_dtype=c.dtype,
            block_size=c.block_size,
            max_num_seqs=max(len(s.requests) + s.filler_requests for s in steps),
            max_model_len=max(r.seq_len for s in steps for r in s.requests),
            scale=c.scale,
        )
        max_blocks = max(len(r.blocks) for s in steps for r in s.requests) + 1
        builder = self.backend.get_builder_cls()(spec, self.device, max_blocks)
        impl = self.backend.get_impl_cls()(
            num_heads=c.num_heads,
            head_size=c.head_size,
            scale=c.scale,
            num_kv_heads=c.num_kv_heads,
            kv_cache_dtype="auto",
            attn_type=AttentionType.DECODER,
        )
        for index, step in enumerate(steps):
            where = f"step {index + 1}/{len(steps)}: " if len(steps) > 1 else ""
            self._run_step(step, builder, impl, kv_cache, num_blocks, max_blocks, where)
        return self.worst, self.problems

    def _slots(self, request: _Request, start: int, end: int) -> torch.Tensor:
        """int64 cache slots of positions ``start:end`` of ``request``."""
        bs = self.case.block_size
        positions = torch.arange(start, end)
        return torch.tensor(request.blocks, dtype=torch.int64)[positions // bs] * bs + positions % bs

    def _run_step(self, step: _Step, builder: Any, impl: Any, kv_cache: torch.Tensor, num_blocks: int,
                  max_blocks: int, where: str) -> None:
        c = self.case
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_size
        flat_k = self.expected_k.view(-1, Hkv, D)
        flat_v = self.expected_v.view(-1, Hkv, D)
        key_view, value_view = self.backend.split_kv_cache(kv_cache)

        if step.prewrite_context:
            for r in step.requests:
                if r.context_len:
                    slots = self._slots(r, 0, r.context_len)
                    flat_k[slots] = self.randn(r.context_len, Hkv, D)
                    flat_v[slots] = self.randn(r.context_len, Hkv, D)
            key_view.copy_(self.expected_k)
            value_view.copy_(self.expected_v)

        num_actual = sum(r.query_len for r in step.requests)
        num_fillers = step.filler_requests
        num_tokens = num_actual + step.padding_tokens + num_fillers
        num_reqs = len(step.requests) + num_fillers

        real_slots = torch.cat([self._slots(r, r.context_len, r.seq_len) for r in step.requests])
        slot_mapping = torch.cat([real_slots, torch.full((num_tokens - num_actual,), -1, dtype=torch.int64)])
        query_lens = [r.query_len for r in step.requests] + [1] * num_fillers
        seq_lens = [r.seq_len for r in step.requests] + [1] * num_fillers
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        # Entries past a request's last block hold arbitrary valid block ids; fillers use row 0.
        block_table = torch.randint(0, num_blocks, (num_reqs, max_blocks), generator=self.gen, dtype=torch.int32)
        for i, r in enumerate(step.requests):
            block_table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        block_table[len(step.requests):] = 0

        # query/key/value as views of one fused projection, as models pass them.
        qkv = self.randn(num_tokens, (H + 2 * Hkv) * D)
        q_cpu = qkv[:, : H * D].view(num_tokens, H, D)
        k_cpu = qkv[:, H * D : (H + Hkv) * D].view(num_tokens, Hkv, D)
        v_cpu = qkv[:, (H + Hkv) * D :].view(num_tokens, Hkv, D)
        qkv_dev = qkv.to(self.device)
        query = qkv_dev[:, : H * D].view(num_tokens, H, D)
        key = qkv_dev[:, H * D : (H + Hkv) * D].view(num_tokens, Hkv, D)
        value = qkv_dev[:, (H + Hkv) * D :].view(num_tokens, Hkv, D)

        qsl_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(self.device),
            seq_lens=seq_cpu.to(self.device),
            block_table=block_table.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            num_reqs=num_reqs,
            num_actual_tokens=num_actual,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        metadata = builder.build(common)
        output = torch.full((num_tokens, H, D), float("nan"), dtype=c.dtype, device=self.device)
        result = impl.forward(query, key, value, kv_cache, metadata, output)
        if result is not None and result.data_ptr() != output.data_ptr():
            self.problems.append(f"{where}forward returned a tensor other than `output`")

        # Expected cache: the real tokens at their slots, nothing else.
        flat_k[real_slots] = k_cpu[:num_actual]
        flat_v[real_slots] = v_cpu[:num_actual]
        self._check_cache(key_view, value_view, set(real_slots.tolist()), where)
        self._check_output(output[:num_actual].cpu(), q_cpu, step, query_start_loc, where)

    def _check_cache(self, key_view: torch.Tensor, value_view: torch.Tensor, written: set[int], where: str) -> None:
        bs = self.case.block_size
        for label, actual, expected in (("key", key_view, self.expected_k), ("value", value_view, self.expected_v)):
            actual = actual.cpu()
            if torch.equal(actual, expected):
                continue
            differs = (actual != expected).flatten(2).any(-1).flatten()  # per slot
            bad = differs.nonzero().squeeze(1).tolist()
            stray = [s for s in bad if s not in written]
            wrong = [s for s in bad if s in written]
            parts = []
            if wrong:
                parts.append(f"{len(wrong)} slot(s) of real tokens hold wrong values (e.g. slot {wrong[0]}"
                             f" = block {wrong[0] // bs} offset {wrong[0] % bs})")
            if stray:
                parts.append(f"{len(stray)} slot(s) changed that no real token maps to (e.g. slot {stray[0]} = "
                             f"block {stray[0] // bs} offset {stray[0] % bs}; padding/slot -1 written?)")
            self.problems.append(f"{where}{label} cache: " + "; ".join(parts))

    def _check_output(self, out: torch.Tensor, q: torch.Tensor, step: _Step, starts: list[int], where: str) -> None:
        c = self.case
        Hkv, D = c.num_kv_heads, c.head_size
        unwritten = (~torch.isfinite(out)).flatten(1).any(-1)
        if bool(unwritten.any()):
            rows = unwritten.nonzero().squeeze(1).tolist()
            self.problems.append(
                f"{where}output not fully written or not finite: {len(rows)} of {out.shape[0]} token rows "
                f"(e.g. row {rows[0]}) hold NaN/inf (outputs are poisoned with NaN before the call)"
            )
            return
        k_all = self.expected_k.view(-1, Hkv, D)
        v_all = self.expected_v.view(-1, Hkv, D)
        for i, r in enumerate(step.requests):
            slots = self._slots(r, 0, r.seq_len)
            ref = _reference_attention(q[starts[i] : starts[i + 1]], k_all[slots], v_all[slots], r.context_len, c.scale)
            got = out[starts[i] : starts[i + 1]].double()
            err = float((got - ref).norm() / ref.norm())
            if not err <= self.worst:  # also catches NaN
                self.worst = err
                self.worst_where = f"{where}request {i} (context {r.context_len}, query {r.query_len})"


def _reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """float64 causal attention of ``q [n, H, D]`` over ``keys/values [seq, Hkv, D]``;
    query j sits at position context_len + j."""
    n, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(context_len, context_len + n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    backend: str | type[AttentionBackend],
    case: ConformanceCase,
    device: str = "cpu",
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
) -> CaseResult:
    """Run one case; never raises for backend errors (they become a failed result)."""
    cls = resolve_backend(backend)
    dev = torch.device(device)
    seed = _default_seed(seed)
    tol = {**DEFAULT_TOLERANCES, **(tolerances or {})}.get(case.dtype)
    if tol is None:
        raise ValueError(
            f"tolerances: no tolerance for dtype {dtype_name(case.dtype)} (pass tolerances={{dtype: tol}})"
        )
    params = {**case.params, "seed": seed}

    def result(**kw: Any) -> CaseResult:
        return CaseResult(name=case.name, params=params, tolerance=tol, **kw)

    problem = _device_problem(dev)
    if problem:
        return result(rel_error=None, passed=False, message=problem)
    reasons = cls.validate_configuration(
        AttentionSelectorConfig(
            head_size=case.head_size,
            dtype=case.dtype,
            kv_cache_dtype="auto",
            block_size=case.block_size,
            attn_type=AttentionType.DECODER,
            device_type=dev.type,
            device_capability=_device_capability(dev),
            num_heads=case.num_heads,
            num_kv_heads=case.num_kv_heads,
        )
    )
    if reasons:
        return result(rel_error=None, passed=False, skipped=True, message="; ".join(reasons))

    runner = _CaseRunner(cls, case, dev, _case_seed(seed, case))
    started = time.perf_counter()
    try:
        worst, problems = runner.run()
    except Exception as exc:  # a crashing backend is a failed case, reported with its traceback
        tb = traceback.format_exc(limit=-4).strip().replace("\n", "\n     ")
        return result(rel_error=None, passed=False, message=f"{type(exc).__name__}: {exc}\n     {tb}",
                      seconds=time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if not problems and not (worst <= tol):
        problems.append(f"relative error {worst:.3e} > tolerance {tol:.0e} (worst: {runner.worst_where})")
    return result(rel_error=worst, passed=not problems, message="; ".join(problems), seconds=seconds)


def run_conformance(
    backend: str | type[AttentionBackend],
    device: str = "cpu",
    quick: bool = False,
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
    cases: Sequence[ConformanceCase] | None = None,
) -> ConformanceReport:
    """Run the suite (or the given ``cases``) against ``backend`` on ``device``.

    ``backend`` is a NAME resolved through ``kvloom.attention.selector.get_attention_backend`` or an
    ``AttentionBackend`` subclass. ``tolerances`` overrides the per-dtype relative-error
    limits of ``DEFAULT_TOLERANCES``.
    """
    seed = _default_seed(seed)
    name = backend if isinstance(backend, str) else getattr(backend, "NAME", backend.__name__)
    report = ConformanceReport(backend=name, device=str(device), seed=seed, quick=quick)
    try:
        cls = resolve_backend(backend)
    except Exception as exc:
        report.errors.append(f"cannot load backend {name!r}: {type(exc).__name__}: {exc}")
        return report
    if cls.is_mla:
        report.errors.append(f"{name} is an MLA backend; this suite covers standard (MHA/GQA/MQA) attention only")
        return report
    if torch.device(device).type not in cls.supported_device_types:
        report.errors.append(
            f"{name} does not support device type {torch.device(device).type} "
            f"(supports {', '.join(cls.supported_device_types)})"
        )
        return report
    problem = _device_problem(torch.device(device))
    if problem:
        report.errors.append(problem)
        return report
    for case in cases if cases is not None else conformance_cases(cls, device, quick):
        res = run_case(cls, case, device, seed, tolerances)
        logger.debug("%s", res.format())
        report.cases.append(res)
    return report


def check_case(
    backend: str | type[AttentionBackend],
    case: ConformanceCase,
    device: str = "cpu",
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
) -> CaseResult:
    """pytest helper: run one case; skip it when the backend rejects the configuration on
    this device, fail with the case's message and seed when it does not pass."""
    seed = _default_seed(seed)
    res = run_case(backend, case, device, seed, tolerances)
    if res.skipped:
        import pytest

        pytest.skip(f"{case.name}: {res.message}")
    if not res.passed:
        raise AssertionError(f"{res.format()}\n     reproduce with {SEED_ENV}={seed}")
    return res
