"""The float64 reference attention of kvloom's tests and benchmarks, and the random paged
batches they check attention backends with.

``reference_attention`` computes, on the CPU in float64, what the backend contract
(``kvloom.attention.backend``) asks ``AttentionImpl.forward`` to write for the real tokens
of a step: each request's queries attend causally to its whole sequence, read from the
paged KV cache through its block-table row (GQA: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``). It reads the cache *after* the step's write, so the
request's new tokens are in it. The contract's attention features are part of it
(``AttentionFeatures``): a sliding window (HF's: ``W`` keys up to the query's own
position), attention sinks as gpt-oss defines them (a per-head logit in the softmax's
denominator that carries no value) and logit soft-capping as Gemma 2 does
(``cap * tanh(s / cap)`` on the scaled scores, before the mask).

``PagedCache`` holds a backend's cache on the device next to what it must hold (CPU
copies); ``PagedCache.step`` builds one step over it to the contract's layout: ``query``/
``key``/``value`` as views of one fused QKV tensor (as models pass them), requests on
shuffled physical blocks, block-table entries past a request's last block holding
arbitrary *valid* block ids, CUDA-graph padding (extra token rows and filler requests with
slot ``-1``), and the expected output and cache of a correct step. Cache slots nobody
wrote hold NaN, zeros or large random values (``fill``), so reading past a sequence shows.
With a sliding window, the blocks wholly before a request's window are filled with NaN
(as blocks the KV-cache manager gave back may hold anything), so a backend that reads
them, even masked, shows.
``run_paged_case`` runs a backend's own builder and impl on a step with its output
poisoned with NaN; ``check_paged_case`` compares output and cache with the expectations.

``make_paged_case`` is the one-step shortcut from query and sequence lengths (backend
tests, ``benchmarks/bench_attention_kernels.py``); the conformance suite
(``kvloom.testing.conformance``) plans multi-step scenarios on ``PagedCache`` directly.
Tests of CUDA-graph replay run several steps over one ``PagedCache`` (requests placed with
``place_requests``; a step of filler requests alone is the dummy capture batch) and copy
each new step into the captured one's tensors with ``PagedCase.refill_from``.

The references of the custom ops a platform may provide, and the check that holds a
replacement to them, are ``kvloom.testing.custom_ops``.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class AttentionFeatures:
    """The attention features of the contract a case exercises (all off by default)."""

    sliding_window: int | None = None
    """Each query sees the last ``sliding_window`` positions, its own included."""
    logits_soft_cap: float | None = None
    """Scaled scores ``s`` become ``cap * tanh(s / cap)``."""
    sinks: torch.Tensor | None = None
    """float32 ``[num_heads]``: each head's sink logit, in every softmax's denominator."""

    def window_start(self, position: int) -> int:
        """The first position the query at ``position`` sees."""
        return 0 if self.sliding_window is None else max(0, position - self.sliding_window + 1)


NO_FEATURES = AttentionFeatures()


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    features: AttentionFeatures = NO_FEATURES,
    key_start: int = 0,
) -> torch.Tensor:
    """float64 causal attention of one request on the CPU: ``query [n, H, D]`` are the last
    ``n`` positions of the sequence whose positions ``key_start ..`` are ``keys``/``values
    [seq_len - key_start, Hkv, D]`` (``key_start`` > 0 only when no query sees the
    positions before it)."""
    n, num_heads, _ = query.shape
    seq_len = key_start + keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.cpu().double().repeat_interleave(group, dim=1)
    v = values.cpu().double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.cpu().double(), k) * scale
    if features.logits_soft_cap is not None:
        cap = features.logits_soft_cap
        scores = cap * torch.tanh(scores / cap)
    key_pos = torch.arange(key_start, seq_len)[None, :]
    query_pos = torch.arange(seq_len - n, seq_len)[:, None]
    visible = key_pos <= query_pos
    if features.sliding_window is not None:
        visible &= key_pos > query_pos - features.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if features.sinks is not None:
        sink = features.sinks.cpu().double()[:, None, None].expand(num_heads, n, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(-1)[..., : seq_len - key_start]
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    common: CommonAttentionMetadata,
    scale: float,
    features: AttentionFeatures = NO_FEATURES,
) -> torch.Tensor:
    """The output of the step's real tokens, float64 ``[num_actual_tokens, H, D]`` on the
    CPU. ``query [N, H, D]``; ``key_cache``/``value_cache`` indexed ``[block, offset, kv_head,
    dim]`` (as ``split_kv_cache`` gives them) and holding the step's new tokens already.
    Requests whose tokens lie past ``num_actual_tokens`` (CUDA-graph fillers) are skipped.
    With a sliding window only the positions from each request's first query's window on
    are read."""
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
        key_start = features.window_start(seq_len - (end - start))
        positions = torch.arange(key_start, seq_len)
        blocks = block_table[i, positions // block_size].long().to(key_cache.device)
        offsets = (positions % block_size).to(key_cache.device)
        out[start:end] = attend(query[start:end], key_cache[blocks, offsets], value_cache[blocks, offsets], scale,
                                features, key_start)  # fmt: skip
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
    #: The attention features of the layer (window and soft cap as the spec has them).
    features: AttentionFeatures = NO_FEATURES

    @classmethod
    def allocate(
        cls,
        backend: type[AttentionBackend],
        spec: AttentionLayerSpec,
        num_blocks: int,
        device: torch.device | str,
        generator: torch.Generator,
        fill: Fill = "random",
        sinks: bool = False,
    ) -> PagedCache:
        """A cache of ``num_blocks`` blocks whose slots hold ``fill``: "random" (std 4,
        drawn from ``generator``), "nan" or "zeros". The layer's sliding window and soft cap
        are ``spec``'s; ``sinks``: random sink logits (std 2) for the impl."""
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
        sink_logits = _randn(generator, torch.float32, spec.num_heads, std=2.0) if sinks else None
        features = AttentionFeatures(spec.sliding_window, spec.logits_soft_cap, sink_logits)
        return cls(backend, spec, kv_cache, expected_k, expected_v, generator, features)

    @property
    def num_blocks(self) -> int:
        return self.expected_key_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def make_builder(self, max_blocks: int) -> AttentionMetadataBuilder:
        return self.backend.get_builder_cls()(self.spec, self.device, max_blocks)

    def make_impl(self) -> AttentionImpl:
        s, f = self.spec, self.features
        optional: dict[str, Any] = {}  # only what is set: impls older than the features take neither
        if f.logits_soft_cap is not None:
            optional["logits_soft_cap"] = f.logits_soft_cap
        if f.sinks is not None:
            optional["sinks"] = f.sinks.to(self.device)
        return self.backend.get_impl_cls()(
            num_heads=s.num_heads,
            head_size=s.head_size,
            scale=s.scale,
            num_kv_heads=s.num_kv_heads,
            kv_cache_dtype="auto",
            attn_type=AttentionType.DECODER,
            sliding_window=f.sliding_window,
            **optional,
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
        if self.features.sliding_window is not None:
            self._poison_skipped_blocks(requests)

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
                q_cpu, self.expected_key_cache, self.expected_value_cache, common, s.scale, self.features
            ),
        )

    def _poison_skipped_blocks(self, requests: Sequence[PagedRequest]) -> None:
        """NaN in every block wholly before the window of a request's first query (the
        KV-cache manager gives such blocks back; they may hold anything), in the backend's
        cache and the expected one."""
        bs = self.spec.block_size
        skipped = [b for r in requests for b in r.blocks[: self.features.window_start(r.context_len) // bs]]
        if not skipped:
            return
        index = torch.tensor(skipped, dtype=torch.int64)
        self.expected_key_cache[index] = float("nan")
        self.expected_value_cache[index] = float("nan")
        key_view, value_view = self.backend.split_kv_cache(self.kv_cache)
        device_index = index.to(self.device)
        key_view[device_index] = float("nan")
        value_view[device_index] = float("nan")

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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: bool = False,
) -> PagedCase:
    """A step of ``len(query_lens)`` requests on shuffled blocks of a fresh cache; request
    r has ``seq_lens[r] - query_lens[r]`` cached positions and ``query_lens[r]`` new tokens
    (see ``place_requests``).

    ``pad_tokens``: extra token rows after the real ones with slot -1 (CUDA-graph token
    padding). ``pad_reqs``: filler requests the way the runner pads a decode batch for a
    graph (query_len 1, seq_len 1, block-table row 0, slot -1); with no requests, the
    fillers alone are a graph's dummy capture batch. ``extra_blocks``: spare blocks no
    request owns. ``scale`` defaults to ``1/sqrt(head_size)``; ``fill``: what the slots no
    request writes hold (see ``PagedCache.allocate``). ``sliding_window``,
    ``logits_soft_cap`` and ``sinks`` (random sink logits) are the attention features of
    the layer (``AttentionFeatures``).
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
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    cache = PagedCache.allocate(backend, spec, num_blocks, device, gen, fill, sinks=sinks)
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
