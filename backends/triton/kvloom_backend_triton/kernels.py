"""Triton kernels of TRITON_ATTN: KV-cache write, mixed-batch attention, split-KV decode.

Cache layout (one layer): ``(2, num_blocks, PAGE_SIZE, num_kv_heads, head_size)``; the
kernels receive the key and value halves and their (shared) strides, with the head
dimension contiguous so each cached token's head is one run of ``head_size`` elements
(16-byte vector loads).

Grouped-query attention: every program owns one KV head and *all* query heads that share
it, packed as rows of the ``tl.dot`` operand (row = query token x group member), so each
K/V tile is read from memory once per KV head, not once per query head.

Scores are kept in the log2 domain (``qk_scale = softmax_scale * log2(e)``, ``exp2``):
one multiply per score instead of a multiply plus the ``exp`` range reduction. The
attention features of the contract work in that domain too: a soft cap ``c`` becomes
``c * log2(e)`` (``c tanh(s / c)`` scales with ``s``), a sink logit is multiplied by
``log2(e)``. A sliding window ``W`` (``WINDOW``) narrows the positions a program reads to
``first query position - W + 1 ..``: the blocks before it may have been given back, so
they are neither read nor counted; the tiles some row sees only in part are masked.

CUDA-graph rule: nothing here reads a host-side per-request number. Lengths, block-table
rows and query offsets are loaded from device tensors inside the kernels; the host only
chooses grids from the (padded) batch shape and fixed limits (see ``builder.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``: copy one token's K and V heads
    into the cache slot ``slot_mapping[token]``; slot ``-1`` (padding) writes nothing."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :] & (slot >= 0)
    # Masked lanes may compute a nonsense address from slot -1; they never touch memory.
    dst = (
        (slot // PAGE_SIZE) * stride_cache_block
        + (slot % PAGE_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    key = tl.load(key_ptr + token * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    tl.store(value_cache_ptr + dst, value, mask=mask)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_head_offset,
    start,
    kv_lo,
    kv_stop,
    window,
    soft_cap,
    stride_cache_block,
    stride_cache_slot,
    dims,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over cached positions ``start .. start+BLOCK_N``.

    MASKED=False is the fast path for tiles every row sees in full: no bounds or causal
    masks. MASKED=True masks positions ``>= kv_stop`` and, if CAUSAL, positions after each
    row's own ``q_pos``; with WINDOW also positions ``< kv_lo`` (not read: their blocks
    may be gone) and those before each row's window ``q_pos - window + 1``. Without
    WINDOW every row must see at least one position in its first tile, so ``m_i`` is
    finite after the first step and no ``-inf - -inf`` can appear; with WINDOW a row may
    see none of a tile, so the maximum is guarded. SOFT_CAP: scores become
    ``soft_cap * tanh(s / soft_cap)`` (``soft_cap`` in the log2 domain).
    """
    pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        in_range = pos < kv_stop
        if WINDOW:
            in_range = in_range & (pos >= kv_lo)
        page = tl.load(block_table_row_ptr + pos // PAGE_SIZE, mask=in_range, other=0)
    else:
        page = tl.load(block_table_row_ptr + pos // PAGE_SIZE)
    offsets = page.to(tl.int64) * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot + kv_head_offset
    kv_ptrs = offsets[:, None] + dims[None, :]
    if MASKED:
        if HEAD_SIZE == BLOCK_D:
            kv_mask = in_range[:, None]
        else:
            kv_mask = in_range[:, None] & (dims < HEAD_SIZE)[None, :]
        # Masked V rows must be 0, not whatever the cache holds: 0 * NaN is NaN.
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_SIZE == BLOCK_D:
        k = tl.load(k_cache_ptr + kv_ptrs)
        v = tl.load(v_cache_ptr + kv_ptrs)
    else:
        d_mask = (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=d_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=d_mask, other=0.0)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow trouble.
        s = soft_cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / soft_cap)) + 1.0))
    if MASKED:
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOW:
        # A row that has seen nothing yet keeps m -inf: shift by 0 so p and alpha are 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_range(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_head_offset,
    kv_start,
    full_start,
    full_stop,
    kv_stop,
    kv_lo,
    window,
    soft_cap,
    stride_cache_block,
    stride_cache_slot,
    dims,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Cached positions ``kv_start .. kv_stop``: the tiles of ``full_start .. full_stop``
    (every row sees them in full) without masks, those around them masked (``full_start``
    > ``kv_start`` only with a window: the tiles some row's window starts in)."""
    for start in range(kv_start, full_start, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head_offset,
            start, kv_lo, kv_stop, window, soft_cap, stride_cache_block, stride_cache_slot, dims, qk_scale,
            PAGE_SIZE, HEAD_SIZE, BLOCK_N, BLOCK_D, True, CAUSAL, WINDOW, SOFT_CAP, DOT_PRECISION,
        )
    for start in range(full_start, full_stop, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head_offset,
            start, kv_lo, kv_stop, window, soft_cap, stride_cache_block, stride_cache_slot, dims, qk_scale,
            PAGE_SIZE, HEAD_SIZE, BLOCK_N, BLOCK_D, False, CAUSAL, WINDOW, SOFT_CAP, DOT_PRECISION,
        )
    for start in range(full_stop, kv_stop, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head_offset,
            start, kv_lo, kv_stop, window, soft_cap, stride_cache_block, stride_cache_slot, dims, qk_scale,
            PAGE_SIZE, HEAD_SIZE, BLOCK_N, BLOCK_D, True, CAUSAL, WINDOW, SOFT_CAP, DOT_PRECISION,
        )
    return acc, l_i, m_i


@triton.jit
def _window_bounds(first_pos, last_pos, full_stop, window, BLOCK_N: tl.constexpr):
    """``(kv_lo, kv_start, full_start)`` for rows at positions ``first_pos .. last_pos``
    under a window: the first position any row sees, the tile it lies in, and the first
    tile every row sees in full (at most ``full_stop``)."""
    kv_lo = tl.maximum(first_pos - window + 1, 0)
    kv_start = (kv_lo // BLOCK_N) * BLOCK_N
    full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    return kv_lo, kv_start, tl.minimum(tl.maximum(full_start, kv_start), full_stop)


@triton.jit
def _normalise(acc, l_i, m_i, sink):
    """``acc / l_i``, with the sink's ``exp2(sink)`` (log2 domain) added to the
    denominator when ``sink`` is finite (a row without a sink passes -inf)."""
    m = tl.maximum(m_i, sink)
    m = tl.where(m > float("-inf"), m, 0.0)
    rescale = tl.exp2(m_i - m)
    return acc * rescale[:, None] / (l_i * rescale + tl.exp2(sink - m))[:, None]


@triton.jit(do_not_specialize=["num_reqs"])
def mixed_batch_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,
    qk_scale,
    window,
    soft_cap,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Causal attention for any mix of prefill chunks and decodes.

    Grid ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)``. Request ``r`` owns the
    tiles ``qsl[r] // BLOCK_Q + r ..`` (one more slot than it can need, so the map from
    tile to request depends only on ``query_start_loc``, read here by binary search).
    Tiles past a request's last query token exit at once. A tile holds ``BLOCK_Q``
    query tokens x ``GROUP`` query heads (rows padded to ``BLOCK_M``); it reads the
    cached positions ``0 .. context + last token of the tile``, the fully visible ones
    without masks. With SKIP_SINGLE, requests of one query token are left to
    ``decode_attention_kernel``: their tiles exit at once.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest request r whose first tile slot is <= tile.
    lo = tile * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_slot = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_slot <= tile:
            lo = mid
        else:
            hi = mid - 1
    req = lo

    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_first = (tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    run = q_first < q_len
    if SKIP_SINGLE:
        run = run & (q_len > 1)
    if run:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        row_tok = rows // GROUP
        row_head = kv_head * GROUP + rows % GROUP
        row_valid = (row_tok < BLOCK_Q) & (q_first + row_tok < q_len)
        token = q_begin + q_first + row_tok
        q_pos = context_len + q_first + row_tok
        dims = tl.arange(0, BLOCK_D)
        io_mask = row_valid[:, None] & (dims < HEAD_SIZE)[None, :]

        q = tl.load(q_ptr + token[:, None] * stride_q_tok + row_head[:, None] * stride_q_head + dims[None, :],
                    mask=io_mask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

        block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
        kv_head_offset = kv_head * stride_cache_head
        # Positions < context_len + q_first + 1 are visible to every row of the tile.
        full_stop = ((context_len + q_first + 1) // BLOCK_N) * BLOCK_N
        kv_stop = tl.minimum(seq_len, context_len + q_first + BLOCK_Q)
        kv_lo = kv_stop * 0
        kv_start = kv_lo
        full_start = kv_lo
        if WINDOW:
            kv_lo, kv_start, full_start = _window_bounds(context_len + q_first, kv_stop - 1, full_stop, window,
                                                         BLOCK_N)
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head_offset,
            kv_start, full_start, full_stop, kv_stop, kv_lo, window, soft_cap, stride_cache_block,
            stride_cache_slot, dims, qk_scale, PAGE_SIZE, HEAD_SIZE, BLOCK_N, BLOCK_D, True, WINDOW, SOFT_CAP,
            DOT_PRECISION,
        )

        if SINKS:
            sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            out = _normalise(acc, l_i, m_i, sink)
        else:
            out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_tok + row_head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,
    qk_scale,
    window,
    soft_cap,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_part_row,
    stride_part_head,
    stride_lse_row,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Requests of one query token. Grid ``(num_reqs, num_kv_heads, num_splits)``.

    Program (r, h, s) attends the ``GROUP`` query heads of KV head h (rows padded to
    ``BLOCK_G`` >= 16 for ``tl.dot``) to the s-th of ``num_splits`` equal runs of request
    r's positions (whole ``BLOCK_N`` tiles, the last run shorter), sized here from the
    request's own length: a request's work is spread over the splits whatever the host
    planned for (a CUDA graph plans for ``max_model_len``), but no run is shorter than
    ``MIN_SPLIT_TILES`` tiles, so a short request keeps fewer splits (the rest stay
    empty). That floor also makes a request that fits in one run come out bit for bit as
    in an unsplit launch (its one partial merges with weight 1): eager steps and CUDA
    graphs, planned differently, then give the same output. Requests of more than one
    query token are skipped (a mixed batch runs them through the mixed-batch kernel).
    With SPLIT=False (one split) it writes the output directly; otherwise it writes the
    normalised partial output and its log2-sum-exp for ``decode_reduce_kernel``. A split
    past the sequence's end writes lse -inf. With WINDOW the splits cut the tiles of the
    window (from the one holding ``seq_len - window``) instead of the whole sequence. With
    SINKS an unsplit launch adds the sink to its denominator; split partials leave it to
    the reduction.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token == 1:
        seq_len = tl.load(seq_lens_ptr + req)
        span_start = seq_len * 0
        kv_lo = span_start
        if WINDOW:
            kv_lo = tl.maximum(seq_len - window, 0)
            span_start = (kv_lo // BLOCK_N) * BLOCK_N
        num_tiles = tl.cdiv(seq_len - span_start, BLOCK_N)
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, tl.num_programs(2)), MIN_SPLIT_TILES)
        kv_start = span_start + split * tiles_per_split * BLOCK_N
        kv_stop = tl.minimum(seq_len, kv_start + tiles_per_split * BLOCK_N)
        full_stop = kv_start + (tl.maximum(kv_stop - kv_start, 0) // BLOCK_N) * BLOCK_N
        # Only split 0 can hold the tile the window starts in (masked below kv_lo).
        full_start = kv_start
        if WINDOW:
            full_start = tl.minimum(tl.maximum(tl.cdiv(kv_lo, BLOCK_N) * BLOCK_N, kv_start), full_stop)

        rows = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, BLOCK_D)
        io_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]
        q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                    mask=io_mask, other=0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)

        block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
        kv_head_offset = kv_head * stride_cache_head
        q_pos = seq_len - 1 + rows * 0
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head_offset,
            kv_start, full_start, full_stop, kv_stop, kv_lo, window, soft_cap, stride_cache_block,
            stride_cache_slot, dims, qk_scale, PAGE_SIZE, HEAD_SIZE, BLOCK_N, BLOCK_D, False, WINDOW, SOFT_CAP,
            DOT_PRECISION,
        )

        has_keys = l_i > 0.0
        if SINKS and not SPLIT:
            sink = tl.load(sinks_ptr + heads, mask=rows < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
            out = _normalise(acc, l_i, m_i, sink)
        else:
            out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if SPLIT:
            row = req * tl.num_programs(2) + split
            tl.store(partial_out_ptr + row * stride_part_row + heads[:, None] * stride_part_head + dims[None, :],
                     out, mask=io_mask)
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(partial_lse_ptr + row * stride_lse_row + heads, lse, mask=rows < GROUP)
        else:
            tl.store(out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    num_splits,
    stride_part_row,
    stride_part_head,
    stride_lse_row,
    stride_o_tok,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Grid ``(num_reqs, num_heads)``: merge the splits of one (request, query head).

    Each split holds a normalised output o_s and lse_s = log2(sum of its exp2 scores);
    the result is sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s. Empty
    splits carry lse -inf and weigh 0 (split 0 always holds a position the query sees, so M
    is finite). With SINKS, M also covers the head's sink logit ``z`` (log2 domain) and the
    denominator gains ``2^(z - M)``.
    Requests of more than one query token are skipped, as in ``decode_attention_kernel``.
    """
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token == 1:
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        rows = req * num_splits + splits
        split_valid = splits < num_splits
        lse = tl.load(partial_lse_ptr + rows * stride_lse_row + head, mask=split_valid, other=float("-inf"))
        m = tl.max(lse, 0)
        if SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m = tl.maximum(m, sink)
        weights = tl.exp2(lse - m)
        parts = tl.load(
            partial_out_ptr + rows[:, None] * stride_part_row + head * stride_part_head + dims[None, :],
            mask=(split_valid & (lse > float("-inf")))[:, None] & (dims < HEAD_SIZE)[None, :],
            other=0.0,
        )
        denominator = tl.sum(weights, 0)
        if SINKS:
            denominator += tl.exp2(sink - m)
        out = tl.sum(parts * weights[:, None], 0) / denominator
        tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_SIZE)
