"""Float weights written as GGML blocks: the GGUF method's format writer (tests, fresh checkpoints).

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are written by gguf-py's own quantizers (llama.cpp's
arithmetic); the K-quants, which gguf-py only reads, by the simple quantizers below,
following the published block layouts (``ggml-common.h``): a min/max fit per sub-block,
its scale and min quantized to 6 bits (Q4_K, Q5_K) or the scale to 8 bits (Q6_K). They are
not llama.cpp's error-minimizing searches; they make valid blocks whose dequantization
(``gguf.quants.dequantize``) is within a few percent of the weight.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

Q = GGMLQuantizationType

#: Types this writer makes (the types the conformance kit runs the method on).
WRITABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _round_to(values: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """``clip(round(values / step), 0, top)`` as uint8 (0 where ``step`` is 0)."""
    safe = np.where(step > 0, step, 1)
    return np.clip(np.round(values / safe), 0, top).astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block -> Q4_K / Q5_K's 12 bytes (inverse of
    ``formats.k_scale_min``)."""
    low, high = sc[:, :4], sc[:, 4:]
    mlow, mhigh = mn[:, :4], mn[:, 4:]
    return np.concatenate(
        [low | ((high >> 4) << 6), mlow | ((mhigh >> 4) << 6), (high & 15) | ((mhigh & 15) << 4)], axis=1
    ).astype(np.uint8)


def _k_scaled(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K arithmetic of blocks ``[n, 256]``: float16 ``d``, ``dmin``, 6-bit
    ``sc``, ``mn`` per 32 and codes ``0..levels``."""
    sub = w.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    scale, shift = (sub.max(axis=2) - low) / levels, -low
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (shift.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc, mn = _round_to(scale, d, 63), _round_to(shift, dmin, 63)
    codes = _round_to(sub + (dmin * mn)[..., None], (d * sc)[..., None], levels).reshape(-1, 256)
    return d, dmin, sc, mn, codes


def _nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """Codes ``[n, 256]`` -> 128 bytes: chunk c holds sub-block 2c low, 2c + 1 high."""
    c = (codes & 15).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, codes = _k_scaled(w, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), _nibble_pairs(codes)], axis=1)


def _q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, codes = _k_scaled(w, 31)
    high = ((codes >> 4) & 1).reshape(-1, 8, 32).transpose(0, 2, 1)  # bit j of byte i: sub-block j
    qh = np.packbits(high, axis=2, bitorder="little").reshape(-1, 32)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, _nibble_pairs(codes)]
    return np.concatenate(parts, axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    groups = w.reshape(-1, 16, 16)
    scale = np.abs(groups).max(axis=2) / 31
    d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = _round_to(scale, d, 127)
    codes = _round_to(groups + (32 * d * sc)[..., None], (d * sc)[..., None], 63).reshape(-1, 256)
    low = (codes & 15).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (codes >> 4).reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


_K_WRITERS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(weight: np.ndarray, ggml_type: int) -> np.ndarray:
    """float ``[rows, cols]`` -> raw rows ``uint8 [rows, bytes per row]`` of ``ggml_type``
    (one of ``WRITABLE``; ``cols`` a multiple of its block)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    rows = weight.shape[0]
    writer = _K_WRITERS.get(Q(ggml_type))
    if writer is not None:
        return writer(weight.reshape(-1, 256)).reshape(rows, -1)
    return gguf_quantize(weight, Q(ggml_type)).reshape(rows, -1)
