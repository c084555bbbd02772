"""Triton kernel of MLA prefill: causal varlen attention with qk head dim != v head dim.

MLA's prefill is compute bound, so it runs on decompressed keys and values
(``k = [k_nope | k_pe]``, qk dim ``qk_nope + qk_rope`` e.g. 192; ``v`` e.g. 128), one
dense varlen batch: request ``b`` owns query rows ``cu_q[b]:cu_q[b+1]`` and key/value rows
``cu_k[b]:cu_k[b+1]``. Its query rows are the *last* ``q_len`` positions of its ``k_len``
keys (the first ``k_len - q_len`` are a cached prefix), so query row ``j`` sees keys
``<= k_len - q_len + j`` (bottom-right aligned causal mask).

Grid ``(cdiv(max_q_len, BLOCK_M), num_reqs, num_heads)``; tiles past a request's queries
exit at once. The head dims are padded to powers of two and masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvloom_backend_triton_mla.online_softmax import online_softmax_step


@triton.jit
def varlen_causal_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_q_ptr,
    cu_k_ptr,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    QK_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.program_id(1)
    head = tl.program_id(2)

    q_begin = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_begin
    if tile * BLOCK_M < q_len:
        k_begin = tl.load(cu_k_ptr + req)
        k_len = tl.load(cu_k_ptr + req + 1) - k_begin
        context = k_len - q_len

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = context + rows
        dqk = tl.arange(0, BLOCK_DQK)
        dv = tl.arange(0, BLOCK_DV)
        qk_ok = dqk < QK_DIM
        v_ok = dv < V_DIM
        q = tl.load(
            q_ptr + (q_begin + rows)[:, None].to(tl.int64) * stride_q_tok + head * stride_q_head + dqk[None, :],
            mask=row_ok[:, None] & qk_ok[None, :], other=0.0,
        )
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

        # Keys past the tile's last query position are invisible to every row.
        kv_stop = tl.minimum(k_len, context + tile * BLOCK_M + BLOCK_M)
        for start in range(0, kv_stop, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < kv_stop
            k_rows = (k_begin + cols).to(tl.int64)
            k = tl.load(k_ptr + k_rows[:, None] * stride_k_tok + head * stride_k_head + dqk[None, :],
                        mask=col_ok[:, None] & qk_ok[None, :], other=0.0)
            v = tl.load(v_ptr + k_rows[:, None] * stride_v_tok + head * stride_v_head + dv[None, :],
                        mask=col_ok[:, None] & v_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = col_ok[None, :] & (cols[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            # Rows past q_len and the first tiles of early rows may see nothing yet.
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, GUARD_EMPTY_ROWS=True,
                                                DOT_PRECISION=DOT_PRECISION)  # fmt: skip

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_begin + rows)[:, None].to(tl.int64) * stride_o_tok + head * stride_o_head + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
