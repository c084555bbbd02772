"""The float64 reference attention of kvloom's tests and benchmarks, and the random paged
batches they check attention backends with.

``reference_attention`` computes, on the CPU in float64, what the backend contract
(``kvloom.attention.backend``) asks ``AttentionImpl.forward`` to write for the real tokens
of a step: each request's queries attend causally to its whole sequence, read from the
paged KV cache through its block-table row (GQA: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``). It reads the cache *after* the step's write, so the
request's new tokens are in it.

``PagedCache`` holds a backend's cache on the device next to what it must hold (CPU
copies); ``PagedCache.step`` builds one step over it to the contract's layout: ``query``/
``key``/``value`` as views of one fused QKV tensor (as models pass them), requests on
shuffled physical blocks, block-table entries past a request's last block holding
arbitrary *valid* block ids, CUDA-graph padding (extra token rows and filler requests with
slot ``-1``), and the expected output and cache of a correct step. Cache slots nobody
wrote hold NaN, zeros or large random values (``fill``), so reading past a sequence shows.
``run_paged_case`` runs a backend's own builder and impl on a step with its output
poisoned with NaN; ``check_paged_case`` compares output and cache with the expectations.

``make_paged_case`` is the one-step shortcut from query and sequence lengths (backend
tests, ``benchmarks/bench_attention_kernels.py``); the conformance suite
(``kvloom.testing.conformance``) plans multi-step scenarios on ``PagedCache`` directly.
Tests of CUDA-graph replay run several steps over one ``PagedCache`` (requests placed with
``place_requests``; a step of filler requests alone is the dummy capture batch) and copy
each new step into the captured one's tensors with ``PagedCase.refill_from``.

``lora_delta_reference`` is the float64 definition of the LoRA update (the ``lora_delta``
custom op a platform may provide).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from kvloom.utils import cdiv

#: What the cache slots that no request writes hold.
Fill = Literal["random", "nan", "zeros"]


# ---------------------------------------------------------------------------- reference
def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf when ``out`` holds a non-finite value."""
    out64 = out.to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    ref64 = ref.to(device=out64.device, dtype=torch.float64)
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of one request on the CPU: ``query [n, H, D]`` are the last
    ``n`` positions of the sequence ``keys``/``values [seq_len, Hkv, D]``."""
    n, num_heads, _ = query.shape
    seq_len = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.cpu().double().repeat_interleave(group, dim=1)
    v = values.cpu().double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.cpu().double(), k) * scale
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    common: CommonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The output of the step's real tokens, float64 ``[num_actual_tokens, H, D]`` on the
    CPU. ``query [N, H, D]``; ``key_cache``/``value_cache`` indexed ``[block, offset, kv_head,
    dim]`` (as ``split_kv_cache`` gives them) and holding the step's new tokens already.
    Requests whose tokens lie past ``num_actual_tokens`` (CUDA-graph fillers) are skipped."""
    num_actual = common.num_actual_tokens
    starts = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens_cpu.tolist()
    block_table = common.block_table.cpu()
    block_size = key_cache.shape[1]
    out = torch.full((num_actual, *query.shape[1:]), float("nan"), dtype=torch.float64)
    for i in range(common.num_reqs):
        start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
        if end == start or end > num_actual:
            continue
        positions = torch.arange(seq_len)
        blocks = block_table[i, positions // block_size].long().to(key_cache.device)
        offsets = (positions % block_size).to(key_cache.device)
        out[start:end] = attend(query[start:end], key_cache[blocks, offsets], value_cache[blocks, offsets], scale)
    return out


# ---------------------------------------------------------------------------- paged batches
@dataclass
class PagedRequest:
    """One request of a step: ``context_len`` tokens already in the cache, ``query_len``
    new ones, on the physical ``blocks`` (in order) covering its whole sequence."""

    context_len: int
    query_len: int
    blocks: list[int]

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    def slots(self, start: int, end: int, block_size: int) -> torch.Tensor:
        """int64 cache slots of positions ``start:end``."""
        positions = torch.arange(start, end)
        return torch.tensor(self.blocks, dtype=torch.int64)[positions // block_size] * block_size + positions % block_size


def place_requests(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
) -> list[PagedRequest]:
    """Requests with ``query_lens[r]`` new tokens after ``seq_lens[r] - query_lens[r]``
    cached ones, each on its own physical blocks, taken in shuffled order from
    ``num_blocks`` (blocks left over belong to no request)."""
    if len(query_lens) != len(seq_lens):
        raise ValueError("query_lens and seq_lens must have the same length")
    if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError("each request needs 1 <= query_len <= seq_len")
    blocks_per_req = [cdiv(s, block_size) for s in seq_lens]
    if sum(blocks_per_req) > num_blocks:
        raise ValueError(f"the requests need {sum(blocks_per_req)} blocks of {block_size}; the cache has {num_blocks}")
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    requests = []
    for q_len, s_len, n in zip(query_lens, seq_lens, blocks_per_req):
        requests.append(PagedRequest(s_len - q_len, q_len, physical[:n]))
        physical = physical[n:]
    return requests


def _randn(generator: torch.Generator, dtype: torch.dtype, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).to(dtype)


@dataclass
class PagedCache:
    """A backend's paged KV cache (``kv_cache``, on the device, in the backend's layout)
    and, on the CPU, exactly what it must hold (``expected_key_cache``/
    ``expected_value_cache``, ``[num_blocks, block_size, num_kv_heads, head_size]``).

    Random data comes from ``generator`` in the model dtype (rounded once, so the
    reference sees the exact values the backend sees)."""

    backend: type[AttentionBackend]
    spec: AttentionLayerSpec
    kv_cache: torch.Tensor
    expected_key_cache: torch.Tensor
    expected_value_cache: torch.Tensor
    generator: torch.Generator

    @classmethod
    def allocate(
        cls,
        backend: type[AttentionBackend],
        spec: AttentionLayerSpec,
        num_blocks: int,
        device: torch.device | str,
        generator: torch.Generator,
        fill: Fill = "random",
    ) -> PagedCache:
        """A cache of ``num_blocks`` blocks whose slots hold ``fill``: "random" (std 4,
        drawn from ``generator``), "nan" or "zeros"."""
        shape = backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        kv_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        key_view, value_view = backend.split_kv_cache(kv_cache)
        expected_shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        if tuple(key_view.shape) != expected_shape or tuple(value_view.shape) != expected_shape:
            raise AssertionError(
                f"split_kv_cache gave {tuple(key_view.shape)} / {tuple(value_view.shape)}, "
                f"expected [num_blocks, block_size, num_kv_heads, head_size] = {expected_shape}"
            )
        if fill == "random":
            expected_k = _randn(generator, spec.dtype, *expected_shape, std=4.0)
            expected_v = _randn(generator, spec.dtype, *expected_shape, std=4.0)
        elif fill in ("nan", "zeros"):
            expected_k = torch.full(expected_shape, float("nan") if fill == "nan" else 0.0, dtype=spec.dtype)
            expected_v = expected_k.clone()
        else:
            raise ValueError(f"fill must be 'random', 'nan' or 'zeros', got {fill!r}")
        key_view.copy_(expected_k)
        value_view.copy_(expected_v)
        return cls(backend, spec, kv_cache, expected_k, expected_v, generator)

    @property
    def num_blocks(self) -> int:
        return self.expected_key_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def make_builder(self, max_blocks: int) -> AttentionMetadataBuilder:
        return self.backend.get_builder_cls()(self.spec, self.device, max_blocks)

    def make_impl(self) -> AttentionImpl:
        s = self.spec
        return self.backend.get_impl_cls()(
            num_heads=s.num_heads,
            head_size=s.head_size,
            scale=s.scale,
            num_kv_heads=s.num_kv_heads,
            kv_cache_dtype="auto",
            attn_type=AttentionType.DECODER,
        )

    def step(
        self,
        requests: Sequence[PagedRequest],
        *,
        padding_tokens: int = 0,
        filler_requests: int = 0,
        prewrite_context: bool = True,
        max_blocks: int | None = None,
    ) -> PagedCase:
        """One step of ``requests``; afterwards the expected cache holds their new tokens.

        ``prewrite_context``: fill each request's context with fresh random K/V (in the
        expected cache and, copied whole, in the backend's); False when an earlier step
        wrote it through the backend. ``padding_tokens``: token rows past the real ones that
        belong to no request (slot -1). ``filler_requests``: CUDA-graph fillers (query_len
        1, seq_len 1, block-table row 0, slot -1); a step of fillers alone (no
        ``requests``) is the dummy batch a model runner captures a CUDA graph with.
        ``max_blocks``: block-table width (default: the longest request's block count).
        """
        if not requests and not filler_requests:
            raise ValueError("a step needs at least one request or filler request")
        s = self.spec
        H, Hkv, D, bs = s.num_heads, s.num_kv_heads, s.head_size, s.block_size
        flat_k = self.expected_key_cache.view(-1, Hkv, D)
        flat_v = self.expected_value_cache.view(-1, Hkv, D)

        if prewrite_context:
            for r in requests:
                if r.context_len:
                    slots = r.slots(0, r.context_len, bs)
                    flat_k[slots] = _randn(self.generator, s.dtype, r.context_len, Hkv, D)
                    flat_v[slots] = _randn(self.generator, s.dtype, r.context_len, Hkv, D)
            key_view, value_view = self.backend.split_kv_cache(self.kv_cache)
            key_view.copy_(self.expected_key_cache)
            value_view.copy_(self.expected_value_cache)

        num_actual = sum(r.query_len for r in requests)
        num_tokens = num_actual + padding_tokens + filler_requests
        num_reqs = len(requests) + filler_requests
        if max_blocks is None:
            max_blocks = max((len(r.blocks) for r in requests), default=1)

        written = torch.cat(
            [torch.zeros(0, dtype=torch.int64)] + [r.slots(r.context_len, r.seq_len, bs) for r in requests]
        )
        slot_mapping = torch.cat([written, torch.full((num_tokens - num_actual,), -1, dtype=torch.int64)])
        query_lens = [r.query_len for r in requests] + [1] * filler_requests
        seq_lens = [r.seq_len for r in requests] + [1] * filler_requests
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        # Entries past a request's last block hold arbitrary valid block ids; fillers use row 0.
        block_table = torch.randint(
            0, self.num_blocks, (num_reqs, max_blocks), generator=self.generator, dtype=torch.int32
        )
        for i, r in enumerate(requests):
            block_table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        block_table[len(requests) :] = 0

        # query/key/value as views of one fused projection, as models pass them.
        qkv = _randn(self.generator, s.dtype, num_tokens, (H + 2 * Hkv) * D)
        q_cpu = qkv[:, : H * D].view(num_tokens, H, D)
        k_cpu = qkv[:, H * D : (H + Hkv) * D].view(num_tokens, Hkv, D)
        v_cpu = qkv[:, (H + Hkv) * D :].view(num_tokens, Hkv, D)
        qkv_dev = qkv.to(self.device)

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

        # Expected cache: the real tokens at their slots, nothing else.
        flat_k[written] = k_cpu[:num_actual]
        flat_v[written] = v_cpu[:num_actual]
        return PagedCase(
            cache=self,
            requests=list(requests),
            query=qkv_dev[:, : H * D].view(num_tokens, H, D),
            key=qkv_dev[:, H * D : (H + Hkv) * D].view(num_tokens, Hkv, D),
            value=qkv_dev[:, (H + Hkv) * D :].view(num_tokens, Hkv, D),
            common=common,
            written_slots=written,
            expected_output=reference_attention(
                q_cpu, self.expected_key_cache, self.expected_value_cache, common, s.scale
            ),
        )

    def problems(self, written_slots: torch.Tensor) -> list[str]:
        """How the backend's cache (read back through ``split_kv_cache``) differs from the
        expected one, one message per cache; empty when both match exactly (NaN matches
        NaN). ``written_slots``: the slots the step's real tokens map to."""
        bs = self.spec.block_size
        written = set(written_slots.tolist())
        key_view, value_view = self.backend.split_kv_cache(self.kv_cache)
        messages = []
        for label, actual, expected in (
            ("key", key_view, self.expected_key_cache),
            ("value", value_view, self.expected_value_cache),
        ):
            actual = actual.cpu()
            if torch.equal(actual, expected):
                continue
            same = (actual == expected) | (actual.isnan() & expected.isnan())
            bad = (~same).flatten(2).any(-1).flatten().nonzero().squeeze(1).tolist()  # per slot
            if not bad:
                continue
            stray = [s for s in bad if s not in written]
            wrong = [s for s in bad if s in written]
            parts = []
            if wrong:
                parts.append(f"{len(wrong)} slot(s) of real tokens hold wrong values (e.g. slot {wrong[0]}"
                             f" = block {wrong[0] // bs} offset {wrong[0] % bs})")
            if stray:
                parts.append(f"{len(stray)} slot(s) changed that no real token maps to (e.g. slot {stray[0]} = "
                             f"block {stray[0] // bs} offset {stray[0] % bs}; padding/slot -1 written?)")
            messages.append(f"{label} cache: " + "; ".join(parts))
        return messages


@dataclass
class PagedCase:
    """One step over a ``PagedCache``: its inputs on the device, and what a correct
    forward produces (``expected_output``: float64 ``[num_actual_tokens, H, D]`` on the CPU;
    the expected cache is the ``cache``'s)."""

    cache: PagedCache
    requests: list[PagedRequest]
    query: torch.Tensor  # [N, H, D]
    key: torch.Tensor  # [N, Hkv, D]
    value: torch.Tensor  # [N, Hkv, D]
    common: CommonAttentionMetadata
    written_slots: torch.Tensor  # int64, the real tokens' slots
    expected_output: torch.Tensor

    @property
    def spec(self) -> AttentionLayerSpec:
        return self.cache.spec

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.cache.kv_cache

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def cache_problems(self) -> list[str]:
        """How the backend's cache differs from what it must hold after this step (until
        the next step over the same cache is built)."""
        return self.cache.problems(self.written_slots)

    def refill_from(self, step: PagedCase) -> None:
        """Copy a later ``step`` over the same cache into this case's tensors, in place, the
        way a model runner refills its persistent buffers before replaying a CUDA graph
        captured on them: query/key/value, query start locations, sequence lengths (device
        and CPU), the block table (zero-padded to this case's width) and the slot mapping,
        and the host scalars. A forward on this case's tensors is then checked against
        ``step``: ``check_paged_case(step, PagedRun(output, metadata, None))``."""
        if step.cache is not self.cache:
            raise ValueError("refill_from needs a step over the same PagedCache (the graph's cache)")
        mine, theirs = self.common, step.common
        if (mine.num_reqs, self.query.shape[0]) != (theirs.num_reqs, step.query.shape[0]):
            raise ValueError(
                f"a CUDA graph replays one batch shape: {mine.num_reqs} requests x {self.query.shape[0]} token "
                f"rows, not {theirs.num_reqs} x {step.query.shape[0]}"
            )
        if theirs.block_table.shape[1] > mine.block_table.shape[1]:
            raise ValueError(
                f"the step's block table ({theirs.block_table.shape[1]} columns) is wider than this case's "
                f"({mine.block_table.shape[1]}); build both with the same max_blocks"
            )
        for dst, src in (
            (self.query, step.query),
            (self.key, step.key),
            (self.value, step.value),
            (mine.query_start_loc, theirs.query_start_loc),
            (mine.query_start_loc_cpu, theirs.query_start_loc_cpu),
            (mine.seq_lens, theirs.seq_lens),
            (mine.seq_lens_cpu, theirs.seq_lens_cpu),
            (mine.slot_mapping, theirs.slot_mapping),
        ):
            dst.copy_(src)
        mine.block_table.zero_()
        mine.block_table[:, : theirs.block_table.shape[1]].copy_(theirs.block_table)
        mine.num_actual_tokens = theirs.num_actual_tokens
        mine.max_query_len = theirs.max_query_len
        mine.max_seq_len = theirs.max_seq_len


def make_paged_case(
    backend: type[AttentionBackend],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    scale: float | None = None,
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    extra_blocks: int = 2,
    extra: dict | None = None,
    fill: Fill = "nan",
) -> PagedCase:
    """A step of ``len(query_lens)`` requests on shuffled blocks of a fresh cache; request
    r has ``seq_lens[r] - query_lens[r]`` cached positions and ``query_lens[r]`` new tokens
    (see ``place_requests``).

    ``pad_tokens``: extra token rows after the real ones with slot -1 (CUDA-graph token
    padding). ``pad_reqs``: filler requests the way the runner pads a decode batch for a
    graph (query_len 1, seq_len 1, block-table row 0, slot -1); with no requests, the
    fillers alone are a graph's dummy capture batch. ``extra_blocks``: spare blocks no
    request owns. ``scale`` defaults to ``1/sqrt(head_size)``; ``fill``: what the slots no
    request writes hold (see ``PagedCache.allocate``).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(s, block_size) for s in seq_lens) + extra_blocks
    requests = place_requests(query_lens, seq_lens, block_size=block_size, num_blocks=num_blocks, generator=gen)
    spec = AttentionLayerSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        kv_cache_dtype=dtype,
        block_size=block_size,
        max_num_seqs=max_num_seqs or len(query_lens) + pad_reqs,
        max_model_len=max_model_len or max(seq_lens, default=1),
        scale=head_size**-0.5 if scale is None else scale,
        extra=dict(extra or {}),
    )
    cache = PagedCache.allocate(backend, spec, num_blocks, device, gen, fill)
    return cache.step(requests, padding_tokens=pad_tokens, filler_requests=pad_reqs)


# ---------------------------------------------------------------------------- run and check
@dataclass
class PagedRun:
    """One forward of a ``PagedCase``: the output (poisoned with NaN before the call), the
    backend's metadata, and what ``forward`` returned."""

    output: torch.Tensor
    metadata: Any
    returned: torch.Tensor | None


def run_paged_case(
    case: PagedCase,
    *,
    builder: AttentionMetadataBuilder | None = None,
    impl: AttentionImpl | None = None,
    for_cudagraph: bool = False,
) -> PagedRun:
    """Build the step's metadata and run the impl once (default builder and impl: fresh
    ones for the case's spec; ``for_cudagraph``: ``build_for_cudagraph_capture``)."""
    builder = builder or case.cache.make_builder(case.common.block_table.shape[1])
    impl = impl or case.cache.make_impl()
    metadata = builder.build_for_cudagraph_capture(case.common) if for_cudagraph else builder.build(case.common)
    output = torch.full(case.query.shape, float("nan"), dtype=case.spec.dtype, device=case.query.device)
    returned = impl.forward(case.query, case.key, case.value, case.kv_cache, metadata, output)
    return PagedRun(output, metadata, returned)


@dataclass
class PagedCheck:
    """How a ``PagedRun`` compares with its case."""

    #: Everything wrong other than the size of the error: a returned tensor other than
    #: ``output``, cache mismatches, output rows left unwritten (NaN) or not finite.
    problems: list[str] = field(default_factory=list)
    cache_ok: bool = True
    output_finite: bool = True
    #: Relative error of each real request's output (empty when the output is not finite).
    request_errors: list[float] = field(default_factory=list)

    @property
    def rel_error(self) -> float:
        """The worst request's relative error (inf when the output is not all finite)."""
        return max(self.request_errors, default=0.0) if self.output_finite else float("inf")


def check_paged_case(case: PagedCase, run: PagedRun) -> PagedCheck:
    """Compare ``run`` with ``case``: the whole cache exactly (every real token's K/V at its
    slot, nothing else changed) and each real request's output against the reference."""
    check = PagedCheck()
    if run.returned is not None and run.returned.data_ptr() != run.output.data_ptr():
        check.problems.append("forward returned a tensor other than `output`")
    cache_problems = case.cache_problems()
    check.cache_ok = not cache_problems
    check.problems += cache_problems

    out = run.output[: case.num_actual_tokens].cpu()
    unwritten = (~torch.isfinite(out)).flatten(1).any(-1)
    if bool(unwritten.any()):
        rows = unwritten.nonzero().squeeze(1).tolist()
        check.output_finite = False
        check.problems.append(
            f"output not fully written or not finite: {len(rows)} of {out.shape[0]} token rows "
            f"(e.g. row {rows[0]}) hold NaN/inf (outputs are poisoned with NaN before the call)"
        )
        return check
    starts = case.common.query_start_loc_cpu.tolist()
    for i in range(len(case.requests)):
        rows = slice(starts[i], starts[i + 1])
        check.request_errors.append(relative_error(out[rows], case.expected_output[rows]))
    return check


# ---------------------------------------------------------------------------- LoRA
def lora_delta_reference(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """What the ``lora_delta`` op (``kvloom.interfaces.CUSTOM_OP_SIGNATURES``) computes,
    token by token in float64: ``y[t] + B[s] @ (A[s] @ x[t])`` with ``s = token_slots[t]``
    (the op reads them from its ``LoRAMapping``),
    for ``x [N, in]``, ``y [N, out]``, ``lora_a [slots, R, in]``, ``lora_b [slots, out, R]``
    (slot 0, no adapter, holds zeros). Returns ``[N, out]`` float64."""
    a = lora_a.double()[token_slots.long()]  # [N, R, in]
    b = lora_b.double()[token_slots.long()]  # [N, out, R]
    shrunk = torch.bmm(a, x.double().unsqueeze(-1))  # [N, R, 1]
    return y.double() + torch.bmm(b, shrunk).squeeze(-1)


# ---------------------------------------------------------------------------- MoE
def fused_moe_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """What the ``fused_moe`` op computes, in float64 without intermediate rounding:
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]``
    and ``[g | u] = w13[e] @ hidden[t]``. Returns ``[T, H]`` float64 on ``hidden``'s device.
    Expert by expert (one expert's weights in float64 at a time), so model-sized layers fit."""
    inter = w2.shape[-1]
    x = hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=hidden.device)
    ids = topk_ids.long()
    weights = topk_weights.double()
    for expert in torch.unique(ids).tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[expert].double().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (act @ w2[expert].double().T) * weights[tokens, slots, None])
    return out


# ---------------------------------------------------------------------- custom ops

#: Relative tolerance (max |op - float64 definition| / max |float64 definition|) of the
#: ``lora_delta`` op, by dtype; the torch code stays well inside (fp32 ~4e-7, fp16 ~7e-4,
#: bf16 ~5e-3 on random adapters).
LORA_DELTA_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}

#: Relative tolerance (max |op - float64 definition| / max |float64 definition|) of the
#: ``fused_moe`` op, by dtype; the torch code rounds every GEMM output and the SiLU product
#: to the dtype (fp32 ~1e-6, fp16 ~1e-3, bf16 ~8e-3 on random experts).
FUSED_MOE_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

#: ``qk_norm_rotary``'s largest distance from its torch code, relative to the largest
#: value: the norm's two ulp (see ``NORM_MAX_ULP``) of both rotated halves plus the
#: rotation's own rounding.
QK_NORM_ROTARY_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 3e-3,
                                                       torch.bfloat16: 2.5e-2}  # fmt: skip

#: ``random_sample``: draws per sampled row (default of ``check_custom_op``'s ``draws``),
#: made in ``RANDOM_SAMPLE_CALLS`` calls of the op on the rows repeated
#: ``draws / RANDOM_SAMPLE_CALLS`` times each.
RANDOM_SAMPLE_DRAWS = 4000
RANDOM_SAMPLE_CALLS = 4
#: ``random_sample``: a sampled row fails when its chi-square statistic exceeds the
#: chi-square quantile at this normal quantile (one-sided ~1e-9: a correct op fails a
#: row about once in a billion; a wrong distribution at thousands of draws fails by far).
RANDOM_SAMPLE_Z = 6.0
#: ``random_sample``: tokens are pooled (least likely first) into bins of at least this
#: many expected draws, where the chi-square approximation holds.
RANDOM_SAMPLE_MIN_EXPECTED = 5.0

#: The largest distance of a 16-bit norm from the torch code, in units in the last place.
NORM_MAX_ULP = 2
#: The largest relative distance (max |diff| / max |torch|) of a float32 norm.
NORM_FP32_MAX_REL = 1e-5


def custom_op_reference(name: str) -> Any:
    """The torch code that the custom op ``name`` (a key of
    ``kvloom.interfaces.CUSTOM_OP_SIGNATURES``) replaces: what the layers compute with
    ``--custom-ops none``, with the op's own signature. ``rms_norm`` and
    ``fused_add_rms_norm`` are ``RMSNorm``'s, ``silu_and_mul`` is ``SiluAndMul``'s,
    ``rotary_qk`` is ``RotaryEmbedding.rotate_heads``', ``qk_norm_rotary`` Qwen3's
    ``q_norm``/``k_norm`` and rotation (``LlamaAttention``), ``lora_delta`` the grouped LoRA
    GEMMs (its float64 definition is ``lora_delta_reference``) and ``fused_moe`` the
    per-expert GEMMs of ``FusedMoE`` (float64 definition: ``fused_moe_reference``) and
    ``random_sample`` the sampler's temperature sampling (``random_sample_torch``: a random
    draw, whose distribution ``check_custom_op`` compares). Run it on the device and in
    the dtype your op runs in: ``check_custom_op`` compares the two."""
    from kvloom.layers.activation import silu_and_mul_torch
    from kvloom.layers.custom_ops import OP_SIGNATURES
    from kvloom.layers.fused_moe import fused_moe_torch
    from kvloom.layers.layernorm import fused_add_rms_norm_torch, rms_norm_torch
    from kvloom.layers.rotary import qk_norm_rotary_torch, rotary_qk_torch
    from kvloom.lora.ops import lora_delta_torch
    from kvloom.sample.sampler import random_sample_torch

    references = {
        "rms_norm": rms_norm_torch,
        "fused_add_rms_norm": fused_add_rms_norm_torch,
        "silu_and_mul": silu_and_mul_torch,
        "rotary_qk": rotary_qk_torch,
        "qk_norm_rotary": qk_norm_rotary_torch,
        "lora_delta": lora_delta_torch,
        "fused_moe": fused_moe_torch,
        "random_sample": random_sample_torch,
    }
    if name not in OP_SIGNATURES or name not in references:
        raise ValueError(f"unknown custom op {name!r} (known: {', '.join(sorted(OP_SIGNATURES))})")
    return references[name]


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers ordered like their values (adjacent floats differ by 1)."""
    i = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


def _assert_relative(
    report: dict[str, Any], name: str, got: torch.Tensor, reference: torch.Tensor,
    tolerances: dict[torch.dtype, float], what: str,
) -> None:  # fmt: skip
    """``max |got - reference| / max |reference|`` (into ``report["max_rel"]``) is within
    ``tolerances[got.dtype]`` (1e-5 for a dtype it does not name); ``what`` names the
    reference in the error."""
    rel = ((got.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30)).item()
    report["max_rel"] = rel
    tolerance = tolerances.get(got.dtype, 1e-5)
    assert rel <= tolerance, f"{name}: {rel:.3g} (relative) from {what}; allowed {tolerance}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _chi_square_bound(dof: int, z: float) -> float:
    """The chi-square(dof) quantile at the standard normal quantile ``z``
    (Wilson-Hilferty; above the exact quantile for one degree of freedom)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of a row's token ``counts`` against ``probs``
    (float64; tokens of probability 0, never drawn, add nothing), with tokens pooled least likely first
    into bins of at least ``RANDOM_SAMPLE_MIN_EXPECTED`` expected draws."""
    expected = probs * draws
    order = torch.argsort(expected)
    bins: list[tuple[float, float]] = []
    exp_sum = obs_sum = 0.0
    for exp, obs in zip(expected[order].tolist(), counts[order].tolist()):  # lists: fast at 150K tokens
        exp_sum += exp
        obs_sum += obs
        if exp_sum >= RANDOM_SAMPLE_MIN_EXPECTED:
            bins.append((obs_sum, exp_sum))
            exp_sum = obs_sum = 0.0
    if exp_sum > 0 or obs_sum > 0:  # a remainder under the minimum joins the last bin
        last_obs, last_exp = bins.pop() if bins else (0.0, 0.0)
        bins.append((last_obs + obs_sum, last_exp + exp_sum))
    statistic = sum((obs - exp) ** 2 / exp for obs, exp in bins)
    return statistic, len(bins) - 1


def _repeat_rows(t: torch.Tensor, times: int) -> torch.Tensor:
    """``t.repeat(times, 1)`` (row i of copy c at row c * rows + i), keeping ``t``'s row
    stride when its rows are strided: the padding between rows holds 1e4, a logit that
    would win wherever an op reads past a row's end."""
    rows, vocab = t.shape
    repeated = t.repeat(times, 1)
    if t.stride(1) != 1 or t.stride(0) <= vocab:
        return repeated
    padded = torch.full((rows * times, t.stride(0)), 1e4, dtype=t.dtype, device=t.device)
    padded[:, :vocab] = repeated
    return padded[:, :vocab]


def _check_random_sample(op: Any, args: tuple[Any, ...], out: torch.Tensor, expected: torch.Tensor,
                         draws: int) -> dict[str, Any]:  # fmt: skip
    """The distributional part of ``random_sample``'s contract (see ``check_custom_op``)."""
    logits, temperature, greedy = args
    rows, vocab = logits.shape
    assert out.device == logits.device, f"random_sample: out is on {out.device}, not the logits' ({logits.device})"
    greedy_rows = greedy.cpu() if greedy is not None else torch.zeros(rows, dtype=torch.bool)
    want = expected.cpu()

    def check_call(got: torch.Tensor, copies: int) -> torch.Tensor:
        got = got.cpu()
        assert bool(((got >= 0) & (got < vocab)).all()), (
            f"random_sample: token ids outside 0..{vocab - 1}: {got[(got < 0) | (got >= vocab)][:5].tolist()}"
        )
        mask = greedy_rows.repeat(copies)
        assert torch.equal(got[mask], want.repeat(copies)[mask]), (
            "random_sample: greedy rows differ from the torch code's argmax"
        )
        return got

    check_call(out, 1)
    sampled_rows = (~greedy_rows).nonzero().flatten().tolist()
    report: dict[str, Any] = {"draws": 0, "max_chi2_ratio": 0.0}
    if not sampled_rows:
        return report
    calls = RANDOM_SAMPLE_CALLS
    copies = max(1, -(-draws // calls))
    big_logits = _repeat_rows(logits, copies)
    big_temperature = temperature.repeat(copies)
    big_greedy = greedy.repeat(copies) if greedy is not None else None
    outputs = []
    for _ in range(calls):
        got = op(big_logits, big_temperature, big_greedy)
        assert isinstance(got, torch.Tensor) and got.shape == (rows * copies,) and got.dtype == torch.int64, (
            f"random_sample: out on {rows * copies} rows is {getattr(got, 'shape', got)}, expected "
            f"({rows * copies},) int64"
        )
        outputs.append(check_call(got, copies).view(copies, rows))
    samples = torch.cat(outputs)  # [calls * copies, rows]
    total = samples.shape[0]
    scaled = (logits.float() / temperature.unsqueeze(1)).cpu().double()  # the torch code's float32 division
    probs = torch.softmax(scaled, dim=1)
    # Two independent calls repeat all their draws of rows with sum(p**2) < 0.5 with
    # probability below 0.5**copies.
    if copies >= 40 and any(float((probs[row] ** 2).sum()) < 0.5 for row in sampled_rows):
        first, second = outputs[0][:, sampled_rows], outputs[1][:, sampled_rows]
        assert not torch.equal(first, second), "random_sample: two calls drew the same tokens: fresh noise per call"
    for row in sampled_rows:
        counts = torch.bincount(samples[:, row], minlength=vocab).double()
        impossible = (probs[row] == 0) & (counts > 0)
        assert not bool(impossible.any()), (
            f"random_sample: row {row} drew tokens of probability 0: {impossible.nonzero().flatten()[:5].tolist()}"
        )
        statistic, dof = _chi_square(counts, probs[row], total)
        if dof == 0:
            continue
        bound = _chi_square_bound(dof, RANDOM_SAMPLE_Z)
        report["max_chi2_ratio"] = max(report["max_chi2_ratio"], statistic / bound)
        assert statistic <= bound, (
            f"random_sample: row {row}'s token frequencies over {total} draws do not follow softmax(logits / "
            f"temperature): chi-square {statistic:.1f} > {bound:.1f} ({dof} degrees of freedom)"
        )
    report["draws"] = total
    return report


def check_custom_op(name: str, op: Any, *args: Any, draws: int = RANDOM_SAMPLE_DRAWS) -> dict[str, Any]:
    """Run the custom op ``op`` (your platform's kernel for ``name``) and its torch code
    (``custom_op_reference(name)``) on ``args`` and hold ``op`` to kvloom's contract;
    raise ``AssertionError`` saying what differs, else return a report (``passed``,
    ``exact``: the fraction of bit-identical elements, ``max_ulp`` for 16-bit norms,
    ``max_rel`` for float32 norms, ``lora_delta`` and ``fused_moe``). The contract, per op:

    - every op: new output tensors of the reference's shapes and dtypes, and every input
      left untouched (``lora_delta`` excepted: it may add the update to ``y`` in place);
    - ``silu_and_mul``, ``rotary_qk``, and the residual sum (second output) of
      ``fused_add_rms_norm``: bit-identical to the torch code;
    - ``rms_norm`` and the normalised output of ``fused_add_rms_norm``: at most
      ``NORM_MAX_ULP`` (2) ulp from the torch code in float16/bfloat16 (a kernel may sum
      the squares in another order: the fp32 variance then differs in its last bit, the
      normalised value by one ulp, the product with the weight by up to two; kvloom's CUDA
      kernels do), at most ``NORM_FP32_MAX_REL`` (1e-5) relative in float32;
    - ``qk_norm_rotary``: within ``QK_NORM_ROTARY_TOLERANCES[dtype]`` (relative to the
      largest value) of the torch code (a norm, as above, then ``rotary_qk``);
    - ``lora_delta``: within ``LORA_DELTA_TOLERANCES[dtype]`` (relative to the largest
      value) of the float64 definition ``lora_delta_reference``; rows of tokens without
      an adapter (slot 0) are ``y`` exactly;
    - ``fused_moe``: within ``FUSED_MOE_TOLERANCES[dtype]`` (relative to the largest value)
      of the float64 definition ``fused_moe_reference``;
    - ``random_sample`` (``logits, temperature, greedy``), a random draw: output ``[B]``
      int64 on the logits' device, token ids in ``0..V-1``, greedy rows equal to the
      torch code's ``argmax`` exactly; and ``draws`` (default ``RANDOM_SAMPLE_DRAWS``)
      draws per sampled row, from ``RANDOM_SAMPLE_CALLS`` calls on the rows repeated
      (strided rows stay strided), follow ``softmax(logits.float() / temperature)``: no
      token of probability 0, and each row's chi-square statistic (tokens pooled into bins
      of >= 5 expected draws) within its quantile at ``RANDOM_SAMPLE_Z`` (6) standard
      deviations; and two calls do not repeat all their draws. Use small vocabularies
      (8-64 tokens), NaN-free logits, temperatures other than 1 and spread logits (so that
      an op ignoring the temperature, or taking the argmax, fails); report ``draws`` and
      ``max_chi2_ratio`` (largest statistic / bound).

    Use random inputs of your model's shapes, on your device, for every dtype you enable
    the op for."""
    reference = custom_op_reference(name)

    def clone(values: tuple[Any, ...]) -> list[Any]:
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]

    before = clone(args)
    expected = reference(*clone(args))
    actual = op(*args)
    for i, (arg, original) in enumerate(zip(args, before)):
        if isinstance(arg, torch.Tensor) and not (name == "lora_delta" and i == 1):
            assert _same_bits(arg, original), f"{name} changed its argument {i}: inputs must be left untouched"
    labels = ("normed", "residual") if name == "fused_add_rms_norm" else ("out",)
    actual_t = actual if isinstance(actual, tuple) else (actual,)
    expected_t = expected if isinstance(expected, tuple) else (expected,)
    assert len(actual_t) == len(expected_t), f"{name}: returned {len(actual_t)} tensors, expected {len(expected_t)}"
    report: dict[str, Any] = {"name": name, "passed": False}
    for label, got, want in zip(labels, actual_t, expected_t):
        assert isinstance(got, torch.Tensor), f"{name}: {label} is {type(got).__name__}, not a tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{name}: {label} is {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        )
        got_c, want_c = got.detach().cpu(), want.detach().cpu()
        exact = (_bits(got_c) == _bits(want_c)).float().mean().item() if got_c.numel() else 1.0
        report["exact"] = min(report.get("exact", 1.0), exact)
        if name in ("rms_norm", "fused_add_rms_norm") and label != "residual":
            if got_c.dtype == torch.float32:
                rel = ((got_c - want_c).abs().max() / (want_c.abs().max().clamp_min(1e-30))).item()
                report["max_rel"] = rel
                assert rel <= NORM_FP32_MAX_REL, (
                    f"{name}: {label} is {rel:.3g} (relative) from the torch code; float32 allows {NORM_FP32_MAX_REL}"
                )
            else:
                ulp = int((_ordered_bits(got_c) - _ordered_bits(want_c)).abs().max().item())
                report["max_ulp"] = ulp
                assert ulp <= NORM_MAX_ULP, (
                    f"{name}: {label} is {ulp} ulp from the torch code; {got_c.dtype} allows at most {NORM_MAX_ULP}"
                )
        elif name == "qk_norm_rotary":
            _assert_relative(report, name, got_c, want_c, QK_NORM_ROTARY_TOLERANCES, "the torch code")
        elif name == "lora_delta":
            x, y, lora_a, lora_b, mapping = before
            definition = lora_delta_reference(x, y, lora_a, lora_b, mapping.token_slots.cpu()).cpu()
            _assert_relative(report, name, got_c, definition, LORA_DELTA_TOLERANCES, "the float64 definition")
            base_rows = mapping.token_slots.cpu() == 0
            assert _same_bits(got_c[: len(base_rows)][base_rows], y.cpu()[: len(base_rows)][base_rows]), (
                f"{name}: rows without an adapter must be y exactly"
            )
        elif name == "random_sample":
            # The original arguments (untouched, as checked above): clones of strided rows
            # would be contiguous.
            report.update(_check_random_sample(op, args, got, want, draws))
        elif name == "fused_moe":
            definition = fused_moe_reference(*[t.cpu() for t in before]).cpu()
            _assert_relative(report, name, got_c, definition, FUSED_MOE_TOLERANCES, "the float64 definition")
        else:
            assert exact == 1.0, (
                f"{name}: {label} differs from the torch code in {1 - exact:.2%} of its elements; it must be "
                "bit-identical"
            )
    report["passed"] = True
    return report
