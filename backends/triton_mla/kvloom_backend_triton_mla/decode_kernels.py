"""Triton kernels of MLA decode over the paged latent cache (flash-decoding).

Latent cache (one layer): ``[num_blocks, PAGE_SIZE, KV_LORA_RANK + ROPE_DIM]``, one vector per
token and no heads: the first ``KV_LORA_RANK`` values are the compressed KV ``c_kv`` (which is
both the key's "nope" part and the value, the up-projections being absorbed into the query
and the output), the last ``ROPE_DIM`` the rotated key ``k_pe``. The query is absorbed too:
``q_nope [B, H, KV_LORA_RANK]`` and ``q_pe [B, H, ROPE_DIM]``. For each head
``score(t) = q_nope . c_kv(t) + q_pe . k_pe(t)`` and ``out = softmax(score) @ c_kv``.

Why it is data-movement friendly: every head reads the same latent vectors, so a program
owns a tile of ``BLOCK_H`` heads and loads each latent tile once for all of them, reusing
the same ``c_kv`` tile for the scores and for the value product.

Split-KV: program ``(request, head tile, split)`` covers one slice of the request's
positions. The slice length is derived *in the kernel* from the request's own ``seq_len``
(``cdiv(seq_len, NUM_SPLITS)`` rounded up to the tile, and never below ``MIN_SPLIT_TILES``
tiles), so the host picks only the split count: grids then depend on the batch size and a
fixed split count, never on this step's lengths, which keeps the launch valid for
CUDA-graph replays. Each split writes its normalised partial output and its log2-sum-exp;
``mla_decode_reduce_kernel`` merges them. The floor keeps a short request in a plan made
for ``max_model_len`` (a CUDA graph's) in one slice: it then merges with weight 1 and
comes out bit for bit as in an eager, unsplit launch.

Scores are kept in the log2 domain (``qk_scale = softmax_scale * log2(e)``, ``exp2``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvloom_backend_triton_mla.online_softmax import online_softmax_step


@triton.jit
def mla_decode_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qk_scale,
    num_heads,
    stride_qn_req,
    stride_qn_head,
    stride_qp_req,
    stride_qp_head,
    stride_cache_block,
    stride_cache_slot,
    stride_bt_req,
    stride_o_req,
    stride_o_head,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_reqs, cdiv(num_heads, BLOCK_H), NUM_SPLITS)``.

    ``SPLIT=False`` (one split) writes ``out`` directly; otherwise the partial output of
    split ``s`` goes to ``partial_out[req, head, s]`` and its log2-sum-exp (``-inf`` for a
    split with no positions: short requests, CUDA-graph fillers) to ``partial_lse``.
    """
    req = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    l_ok = dl < KV_LORA_RANK
    r_ok = dr < ROPE_DIM

    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N), MIN_SPLIT_TILES) * BLOCK_N
    kv_start = split * per_split
    kv_stop = tl.minimum(seq_len, kv_start + per_split)

    q_nope = tl.load(
        q_nope_ptr + req * stride_qn_req + heads[:, None] * stride_qn_head + dl[None, :],
        mask=head_ok[:, None] & l_ok[None, :], other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + req * stride_qp_req + heads[:, None] * stride_qp_head + dr[None, :],
        mask=head_ok[:, None] & r_ok[None, :], other=0.0,
    )
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)

    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for start in range(kv_start, kv_stop, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < kv_stop
        page = tl.load(block_table_row + pos // PAGE_SIZE, mask=in_range, other=0)
        row = page.to(tl.int64) * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot
        # Out-of-range rows load 0, never what the cache holds there: 0 * NaN is NaN.
        ckv = tl.load(kv_cache_ptr + row[:, None] + dl[None, :], mask=in_range[:, None] & l_ok[None, :], other=0.0)
        kpe = tl.load(
            kv_cache_ptr + row[:, None] + KV_LORA_RANK + dr[None, :], mask=in_range[:, None] & r_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q_nope, tl.trans(ckv), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(kpe), s, input_precision=DOT_PRECISION)
        # The loop only visits tiles that start before kv_stop, so every row has a finite
        # score in every tile: no row needs the guard.
        s = tl.where(in_range[None, :], s * qk_scale, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, ckv, GUARD_EMPTY_ROWS=False, DOT_PRECISION=DOT_PRECISION)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    io_mask = head_ok[:, None] & l_ok[None, :]
    if SPLIT:
        tl.store(
            partial_out_ptr + req * stride_po_req + heads[:, None] * stride_po_head + split * stride_po_split
            + dl[None, :],
            out, mask=io_mask,
        )
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse, mask=head_ok)
    else:
        tl.store(out_ptr + req * stride_o_req + heads[:, None] * stride_o_head + dl[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def mla_decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    stride_o_req,
    stride_o_head,
    KV_LORA_RANK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Grid ``(num_reqs, num_heads)``: merge the splits of one (request, head).

    ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M`` the running max,
    accumulated split by split (the splits of a 512-wide latent do not fit registers at
    once). Empty splits (lse ``-inf``) weigh 0; a request with no positions at all (a
    zero-length filler) gets 0, not NaN.
    """
    req = tl.program_id(0)
    head = tl.program_id(1)
    dl = tl.arange(0, BLOCK_L)
    l_ok = dl < KV_LORA_RANK
    lse_base = partial_lse_ptr + req * stride_pl_req + head * stride_pl_head
    out_base = partial_out_ptr + req * stride_po_req + head * stride_po_head

    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    den = tl.full([], 0.0, dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse = tl.load(lse_base + s)
        m_new = tl.maximum(m, lse)
        finite = m_new > float("-inf")
        # Both weights are 0 while every split so far is empty (m_new = -inf).
        alpha = tl.where(finite, tl.exp2(m - m_new), 0.0)
        w = tl.where(finite, tl.exp2(lse - m_new), 0.0)
        part = tl.load(out_base + s * stride_po_split + dl, mask=l_ok, other=0.0)
        acc = acc * alpha + part * w
        den = den * alpha + w
        m = m_new
    out = acc / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + req * stride_o_req + head * stride_o_head + dl, out.to(out_ptr.dtype.element_ty), mask=l_ok)
