"""GGML block types as codes and group parameters: ``weight = scale * code + min``.

Every GGML type the kernels run is, exactly, a grid of small unsigned codes with a float
scale and min per group of 16 or 32 weights along a row (``Decoded``):

============  ==========  =====  ==========================================  ===========
type          codes       group  scale, min                                  kernel
============  ==========  =====  ==========================================  ===========
Q4_0          0..15       32     d, -8 d                                     U4
Q4_1          0..15       32     d, m                                        U4
Q4_K          0..15       32     d * sc, -dmin * mn (6-bit sc, mn)            U4
Q5_0          0..31       32     d, -16 d                                    U8
Q5_1          0..31       32     d, m                                        U8
Q5_K          0..31       32     d * sc, -dmin * mn                          U8
Q6_K          0..63       16     d * sc, -32 d * sc (int8 sc)                U8
Q2_K          0..3        16     d * sc, -dmin * mn (4-bit sc, mn)            U8
Q3_K          0..7        16     d * sc, -4 d * sc (6-bit sc - 32)            U8
Q8_0          -128..127   32     d, 0                                        S8
============  ==========  =====  ==========================================  ===========

(``d``, ``dmin``, ``m`` are the blocks' float16 values; products of a float16 and a 6-bit
integer are exact in float32, so the scales and mins hold the file's values exactly.) The
kernel formats are in ``kernels.c``; ``decode`` reads raw rows of blocks
(``GGUFTensor.raw``), and ``writer`` holds the inverse, for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

#: Kernel formats (``kernels.c``): 4-bit codes in groups of 32, 8-bit codes 0..63 in
#: groups of 16, signed 8-bit codes in groups of 32 without a min.
U4, U8, S8 = 0, 1, 2
FORMAT_NAMES = {U4: "U4", U8: "U8", S8: "S8"}
GROUP = {U4: 32, U8: 16, S8: 32}

#: Float types: a quantized layer computes with them as float32 weights.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


@dataclass
class Decoded:
    """One tensor as codes and group parameters (``[rows, cols]`` and ``[rows, cols / group]``)."""

    fmt: int
    """The kernel format (``U4``, ``U8``, ``S8``)."""
    codes: np.ndarray
    """``uint8`` codes (``int8`` for ``S8``)."""
    scale: np.ndarray
    """float32 scale per group."""
    min: np.ndarray | None
    """float32 min per group (``None`` for ``S8``)."""

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``: ``scale * code + min`` (the kernels' arithmetic)."""
        group = GROUP[self.fmt]
        weight = self.codes.astype(np.float32) * np.repeat(self.scale, group, axis=1)
        return weight if self.min is None else weight + np.repeat(self.min, group, axis=1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[n, 16]`` -> codes ``[n, 32]``: low nibbles first, then high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit ``j`` of ``qh [n, bytes]`` for ``j < count``: ``[n, count]``."""
    return np.unpackbits(qh, axis=1, count=count, bitorder="little")


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins -> ``([n, 8], [n, 8])``."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc, mn


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None


def _k4_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes of nibbles -> ``[n, 256]``: chunk c of 32 bytes holds
    sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sc, mn = k_scale_min(b[:, 4:16])
    return _k4_codes(b[:, 16:144]), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sc, mn = k_scale_min(b[:, 4:16])
    # qh: bit j of byte i is the fifth bit of sub-block j's element i.
    high = _bits(b[:, 16:48], 256).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, 256)
    return _k4_codes(b[:, 48:176]) | (high << 4), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _crumbs(q: np.ndarray, width: int) -> np.ndarray:
    """2-bit fields of ``q [n, halves * width]``: element ``h * 4 * width + s * width + i``
    is bits ``2s..2s+1`` of byte ``h * width + i``."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((q.reshape(q.shape[0], -1, 1, width) >> shifts) & 3).reshape(q.shape[0], -1)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (ql & 15).reshape(-1, 256) | (_crumbs(b[:, 128:192], 32) << 4)
    scale = _f16(b, 208) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, scale, -32 * scale


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales = b[:, 0:16]
    return _crumbs(b[:, 16:80], 32), _f16(b, 80) * (scales & 15), -(_f16(b, 82) * (scales >> 4))


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    packed = b[:, 96:108]
    low = np.concatenate([packed[:, 0:8] & 15, packed[:, 0:8] >> 4], axis=1)
    high = (packed[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    sc = (low | (high.reshape(-1, 16) << 4)).astype(np.float32) - 32
    # hmask: bit j of byte i is set when element 32 j + i is not lowered by 4.
    high_bit = _bits(b[:, 0:32], 256).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, 256)
    scale = _f16(b, 108) * sc
    return _crumbs(b[:, 32:96], 32) | (high_bit << 2), scale, -4 * scale


#: GGML type -> (kernel format, block decoder: ``[n, type_size]`` bytes -> codes
#: ``[n, block]``, scale ``[n, block / group]``, min or None).
DECODERS: dict[int, tuple[int, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]]] = {
    Q.Q4_0: (U4, _q4_0), Q.Q4_1: (U4, _q4_1), Q.Q4_K: (U4, _q4_k),
    Q.Q5_0: (U8, _q5_0), Q.Q5_1: (U8, _q5_1), Q.Q5_K: (U8, _q5_k), Q.Q6_K: (U8, _q6_k),
    Q.Q2_K: (U8, _q2_k), Q.Q3_K: (U8, _q3_k), Q.Q8_0: (S8, _q8_0),
}  # fmt: skip


def decode(raw: np.ndarray, ggml_type: int, cols: int) -> Decoded:
    """Raw rows ``uint8 [rows, bytes per row]`` of a type in ``DECODERS`` -> ``Decoded``."""
    fmt, decoder = DECODERS[ggml_type]
    block, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    rows = raw.shape[0]
    codes, scale, min_ = decoder(np.ascontiguousarray(raw).reshape(-1, type_size))
    group = GROUP[fmt]
    per_block = block // group
    # A scale per 32 where the kernel's groups are 16 (Q5_0, Q5_1, Q5_K): each twice.
    repeat = per_block // scale.shape[1]
    scale = np.repeat(scale, repeat, axis=1).reshape(rows, cols // group).astype(np.float32)
    if min_ is not None:
        min_ = np.repeat(min_, repeat, axis=1).reshape(rows, cols // group).astype(np.float32)
    return Decoded(fmt, codes.reshape(rows, cols), scale, min_)
