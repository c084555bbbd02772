"""4-bit values in 32-bit words, and the one unpacked form every 4-bit format is read into.

Every 4-bit checkpoint format stores eight 4-bit values per int32 word (or two per byte),
with one scale (and maybe a zero point) per group of ``group_size`` input features. They
differ in which dimension is packed, in the order of the eight values in a word, and in
how a value becomes a number. ``formats`` reads each into ``Unpacked``: the values
``q [K, N]`` (0..15, input features by output features), the scales ``[G, N]``, the zero
points ``[G, N]`` (or one constant), and, for act-order checkpoints, the group of each
input feature. ``Unpacked.dequantize`` is the reference every kernel is tested against:

* integer values (AWQ, GPTQ, compressed-tensors ``pack-quantized``):
  ``w = (q - zero) * scale``;
* e2m1 values (MXFP4: gpt-oss, compressed-tensors ``mxfp4-pack-quantized``): ``w = e2m1(q)
  * scale``, ``e2m1`` the 4-bit float (sign, two exponent bits, one mantissa bit:
  0, 0.5, 1, 1.5, 2, 3, 4, 6) and the scale a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import cdiv

#: Values per int32 word.
PACK = 8
#: The zero point of symmetric integer formats (values 0..15 stand for -8..7).
SYMMETRIC_ZERO = 8
#: The magnitudes of the e2m1 codes 0..7 (code 8..15: the same, negative).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_int32(packed: torch.Tensor, dim: int, count: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words along ``dim`` -> ``count`` 4-bit values (uint8) along that dim. Value
    ``8 * w + i`` is nibble ``i`` (bits ``4i..4i+3``) of word ``w``, or, with ``order``,
    nibble ``order.index(i)`` (AWQ: ``order[j]`` is the value in nibble ``j``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[torch.tensor([order.index(i) for i in range(PACK)], device=packed.device)]
    moved = packed.to(torch.int32).movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & 0xF
    values = values.reshape(*moved.shape[:-1], -1)[..., :count]
    return values.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32``: 4-bit values along ``dim`` (padded with zeros to
    a multiple of 8) -> int32 words."""
    moved = values.to(torch.int64).movedim(dim, -1)
    pad = cdiv(moved.shape[-1], PACK) * PACK - moved.shape[-1]
    moved = torch.nn.functional.pad(moved, (0, pad)).reshape(*moved.shape[:-1], -1, PACK)
    if order is not None:
        moved = moved[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = ((moved & 0xF) << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement, as int32 stores it
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_bytes(packed: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 ``[..., B]`` (value ``2b`` in the low nibble of byte ``b``, ``2b + 1`` in the
    high one) -> ``count`` 4-bit values along the last dim."""
    b = packed.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], -1)[..., :count].contiguous()


def pack_bytes(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_bytes`` (an odd count padded with a zero)."""
    v = values.to(torch.uint8)
    if v.shape[-1] % 2:
        v = torch.nn.functional.pad(v, (0, 1))
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()


def e2m1_to_float(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15) -> float32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=q.device)
    return table[q.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float values (already divided by their scale) -> the nearest e2m1 codes, a tie to
    the even code (round to nearest even), clamped to +-6."""
    mags = torch.tensor(E2M1_VALUES, device=x.device)
    midpoints = (mags[1:] + mags[:-1]) / 2
    a = x.abs().float()
    code = torch.bucketize(a, midpoints, right=True)  # midpoints <= a: a tie goes up
    tie = (code > 0) & (a == midpoints[(code - 1).clamp(min=0)]) & (code % 2 == 1)
    code = (code - tie.long()).to(torch.uint8)
    return torch.where(x < 0, code | 8, code)


@dataclass
class Unpacked:
    """One layer's (or one expert's) 4-bit weight, unpacked: ``[K, N]`` = input features by
    output features (a merged layer's shards side by side along ``N``)."""

    q: torch.Tensor
    """uint8 ``[K, N]``: the 4-bit codes."""
    scales: torch.Tensor
    """``[G, N]``: the scale of each group of input features (float16/bfloat16/float32)."""
    group_size: int
    """Input features per group (``K`` for one group per output channel)."""
    zeros: torch.Tensor | None = None
    """uint8 ``[G, N]`` zero points of integer values; ``None``: ``SYMMETRIC_ZERO`` (or, for
    e2m1 values, none)."""
    g_idx: torch.Tensor | None = None
    """int ``[K]``: the group of each input feature (act-order checkpoints); ``None``:
    feature ``k`` is in group ``k // group_size``."""
    e2m1: bool = False
    """The codes are e2m1 floats (MXFP4), not integers."""

    def groups(self) -> torch.Tensor:
        """int64 ``[K]``: each input feature's group."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[0], device=self.q.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (the layer's weight orientation)."""
        groups = self.groups()
        scale = self.scales.float()[groups]
        if self.e2m1:
            return (e2m1_to_float(self.q) * scale).t().contiguous()
        zero = SYMMETRIC_ZERO if self.zeros is None else self.zeros.float()[groups]
        return ((self.q.float() - zero) * scale).t().contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int, zero_point: bool) -> Unpacked:
    """Round-to-nearest int4 of a float ``weight [N, K]``, one scale per ``group_size``
    input features (the format writers' arithmetic: a valid checkpoint of each format,
    not a calibrated one): asymmetric ``scale = (max - min) / 15``, ``zero =
    round(-min / scale)``; symmetric ``scale = amax / 7`` around ``SYMMETRIC_ZERO``."""
    w = weight.float().t()  # [K, N]
    k, n = w.shape
    g = cdiv(k, group_size)
    padded = torch.nn.functional.pad(w, (0, 0, 0, g * group_size - k)).reshape(g, group_size, n)
    valid = (torch.arange(g * group_size) < k).reshape(g, group_size, 1)
    if zero_point:
        lo = torch.where(valid, padded, torch.inf).amin(dim=1).clamp(max=0)
        hi = torch.where(valid, padded, -torch.inf).amax(dim=1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = (-lo / scales).round().clamp(0, 15)
    else:
        scales = (padded.abs().amax(dim=1) / 7).clamp(min=1e-8)
        zeros = torch.full_like(scales, SYMMETRIC_ZERO)
    scales = scales.half().float()  # the checkpoints store float16 scales: quantize with those
    groups = torch.arange(k) // group_size
    q = (w / scales[groups]).round() + zeros[groups]
    q = q.clamp(0, 15).to(torch.uint8)
    return Unpacked(q, scales.half(), group_size, zeros.to(torch.uint8) if zero_point else None)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of a float ``weight [N, K]`` (``K`` a multiple of 32): ``(codes [N, K] uint8,
    e8m0 exponents [N, K / 32] uint8)``, the scale of a block the power of two that maps its
    largest magnitude into e2m1's range (OCP MX: ``2 ** (floor(log2(amax)) - 2)``)."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    codes = float_to_e2m1(blocks / torch.exp2(exponent).unsqueeze(-1)).reshape(n, k)
    return codes, (exponent + 127).to(torch.uint8)
