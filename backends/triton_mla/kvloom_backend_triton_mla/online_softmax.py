"""The online-softmax step both MLA kernels (decode and prefill) take per tile of keys."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, GUARD_EMPTY_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running softmax: ``s`` ``[M, N]`` are the tile's scores in the
    log2 domain (``-inf`` where invisible), ``v`` ``[N, D]`` its values. Returns ``acc``
    ``[M, D]`` rescaled and plus ``p @ v``, the running sum ``l_i`` and max ``m_i`` ``[M]``.

    GUARD_EMPTY_ROWS: a row may have seen no visible key yet (its max still ``-inf``); it is
    shifted by 0 instead, so that ``p`` and ``alpha`` are 0, never ``exp2(-inf - -inf)``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD_EMPTY_ROWS:
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_shift = m_new
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
