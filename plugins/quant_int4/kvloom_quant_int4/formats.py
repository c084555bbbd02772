"""The published 4-bit integer checkpoint formats: their tensors, how each is read into
``packing.Unpacked``, and how one is written (the format writers of the tests).

Per projection ``[N, K]`` (``N`` output features, ``K`` input features, ``G`` groups of
``group_size`` input features):

* **AWQ** (AutoAWQ's ``GEMM`` version, ``quant_method: awq``): ``qweight`` int32 ``[K, N/8]``
  and ``qzeros`` int32 ``[G, N/8]`` packed along the output features, the eight values of
  a word in AutoAWQ's order (nibble ``j`` holds value ``AWQ_ORDER[j]``); ``scales``
  float16 ``[G, N]``; ``w = (q - zero) * scale``.
* **GPTQ** (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` int32 ``[K/8, N]``
  packed along the input features, in order; ``qzeros`` int32 ``[G, N/8]`` packed along
  the output features, storing ``zero - 1`` (``checkpoint_format: gptq``, the original
  format) or ``zero`` (``gptq_v2``); ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``,
  the group of each input feature (act-order, ``desc_act: true``, quantizes the features
  in another order, so groups are not runs of ``group_size`` features).
* **compressed-tensors** ``pack-quantized`` (``weights: {num_bits: 4, type: int}``):
  ``weight_packed`` int32 ``[N, K/8]`` packed along the input features, each value
  ``signed + 8``; ``weight_scale`` ``[N, G]`` in the model's dtype (``[N, 1]`` per channel);
  ``weight_zero_point`` int32 ``[N/8, G]`` packed along the output features (asymmetric
  only); ``weight_shape`` ``[2]``; ``weight_g_idx`` ``[K]`` (``actorder: group``).

A merged layer (``qkv_proj``) holds its shards side by side along ``N``, each starting on
a word of its own where ``N`` is packed. ``Geometry`` says what this tensor-parallel rank
holds; act-order and per-channel scales are kept whole on every rank (the rank's input
features may belong to any group).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvloom.interfaces import ParamLayout, cdiv
from kvloom_quant_int4.packing import (
    PACK,
    SYMMETRIC_ZERO,
    Unpacked,
    pack_int32,
    quantize_int4,
    unpack_int32,
)

#: AutoAWQ's order of the eight values in a word: nibble j holds value AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

ParamSpec = tuple[tuple[int, ...], torch.dtype, ParamLayout]


@dataclass(frozen=True)
class Geometry:
    """The weight one layer (or one expert's projection) holds on this rank."""

    rows: tuple[int, ...]
    """Output features of each shard, this rank's (a merged layer's q/k/v, an expert's gate/up)."""
    cols: int
    """Input features, this rank's."""
    full_cols: int
    """Input features of the checkpoint's projection."""
    col_start: int = 0
    """The first of this rank's input features (row-parallel layers)."""


def take_shards(t: torch.Tensor, dim: int, rows: tuple[int, ...], block: int) -> list[torch.Tensor]:
    """Each shard's entries of ``t`` along ``dim`` (a shard of ``n`` rows takes ``ceil(n / block)``)."""
    parts, start = [], 0
    for n in rows:
        parts.append(t.narrow(dim, start, cdiv(n, block)))
        start += cdiv(n, block)
    return parts


def unpack_shards(
    t: torch.Tensor, dim: int, rows: tuple[int, ...], order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Values packed along ``dim`` by shard (each from a word of its own) -> uint8, shards side by side."""
    return torch.cat([unpack_int32(p, dim, n, order) for p, n in zip(take_shards(t, dim, rows, PACK), rows)], dim=dim)


def fixed_permutation(k: int) -> torch.Tensor:
    """The act-order the writers use: a permutation of ``k`` input features that depends
    on ``k`` only, so the shards of a merged layer (which share their input, and hence, in
    GPTQ, their Hessian and order) get the same one."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(1000 + k))


def exact_16_bit(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in bfloat16 or float16 when that holds each value exactly (the checkpoint
    stored them so: half the bytes for the kernels to read), else as they are."""
    for dtype in (torch.bfloat16, torch.float16):
        narrowed = scales.to(dtype)
        if torch.equal(narrowed.float(), scales.float()):
            return narrowed
    return scales


class Int4Format(ABC):
    """One checkpoint format of 4-bit integer weights with group scales."""

    #: The name in logs and errors.
    name: str = ""

    def __init__(self, group_size: int, zero_point: bool, act_order: bool) -> None:
        self.group_size = group_size
        """Input features per scale; -1: one scale per output channel."""
        self.zero_point = zero_point
        """The checkpoint stores zero points (else values are symmetric around 8)."""
        self.act_order = act_order
        """The checkpoint stores each input feature's group (``g_idx``)."""

    def describe(self) -> str:
        group = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        extras = ("asymmetric" if self.zero_point else "symmetric") + (", act-order" if self.act_order else "")
        return f"{self.name}: int4 weights, {group} scales ({extras})"

    def groups(self, geo: Geometry) -> tuple[int, int, bool]:
        """``(group_size, groups held, cut by rank)``: per-channel and act-order scales are
        held whole by every rank."""
        if self.group_size <= 0:
            return geo.full_cols, 1, False
        if self.act_order:
            return self.group_size, cdiv(geo.full_cols, self.group_size), False
        return self.group_size, cdiv(geo.cols, self.group_size), True

    @abstractmethod
    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        """The checkpoint tensors of a layer of this geometry: name -> (shape, dtype, layout)."""

    @abstractmethod
    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        """The loaded tensors (``params``' names) -> ``Unpacked``."""

    @abstractmethod
    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one float projection ``weight [N, K]``."""

    # ------------------------------------------------------------------ shared pieces
    def _group_indices(self, g_idx: torch.Tensor | None, geo: Geometry) -> torch.Tensor | None:
        """The group of each of this rank's input features into the held scales, or None
        when they are runs of ``group_size`` features (``k // group_size``). A ``g_idx``
        out of order in a checkpoint that declares none is an error."""
        group, _, cut = self.groups(geo)
        if g_idx is None:
            return None
        g_idx = g_idx.long()
        in_order = (torch.arange(geo.cols, device=g_idx.device) + geo.col_start) // group
        if cut:
            if not torch.equal(g_idx, in_order):
                raise ValueError(f"{self.name}: g_idx is not in order, but the config declares no act-order "
                                 "(desc_act / actorder)")  # fmt: skip
            return None
        return None if geo.col_start == 0 and torch.equal(g_idx, in_order) else g_idx

    def _write_groups(self, weight: torch.Tensor) -> tuple[Unpacked, torch.Tensor | None]:
        """Quantize ``weight`` as this format does (act-order: in the writers' fixed order),
        returning the values in feature order and the ``g_idx`` (act-order only)."""
        k = weight.shape[1]
        group = self.group_size if self.group_size > 0 else k
        if not self.act_order:
            return quantize_int4(weight, group, self.zero_point), None
        perm = fixed_permutation(k)
        u = quantize_int4(weight[:, perm], group, self.zero_point)
        q = torch.empty_like(u.q)
        q[perm] = u.q
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        return Unpacked(q, u.scales, group, u.zeros, g_idx), g_idx


class AwqFormat(Int4Format):
    """AutoAWQ's GEMM format (``quant_method: awq``, ``version: gemm``)."""

    name = "awq"

    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        group, g, cut = self.groups(geo)
        words = sum(cdiv(n, PACK) for n in geo.rows)
        in_dim = 0 if cut else None
        return {
            "qweight": ((geo.cols, words), torch.int32, ParamLayout(output_dim=1, input_dim=0, output_block=PACK)),
            "qzeros": ((g, words), torch.int32, ParamLayout(1, in_dim, output_block=PACK, input_block=group)),
            "scales": ((g, sum(geo.rows)), torch.float16, ParamLayout(1, in_dim, input_block=group)),
        }

    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        group, _, _ = self.groups(geo)
        q = unpack_shards(tensors["qweight"], 1, geo.rows, AWQ_ORDER)
        zeros = unpack_shards(tensors["qzeros"], 1, geo.rows, AWQ_ORDER)
        return Unpacked(q, tensors["scales"], group, zeros)

    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        u, _ = self._write_groups(weight)
        assert u.zeros is not None
        return {"qweight": pack_int32(u.q, 1, AWQ_ORDER), "qzeros": pack_int32(u.zeros, 1, AWQ_ORDER),
                "scales": u.scales}  # fmt: skip


class GptqFormat(Int4Format):
    """AutoGPTQ / GPTQModel's format (``quant_method: gptq``); ``v2``: zeros stored as they are."""

    name = "gptq"

    def __init__(self, group_size: int, zero_point: bool, act_order: bool, v2: bool = False) -> None:
        super().__init__(group_size, zero_point, act_order)
        self.v2 = v2
        """``checkpoint_format: gptq_v2``: ``qzeros`` holds the zero points (v1: minus one)."""

    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        group, g, cut = self.groups(geo)
        n, words = sum(geo.rows), sum(cdiv(r, PACK) for r in geo.rows)
        in_dim = 0 if cut else None
        return {
            "qweight": (
                (cdiv(geo.cols, PACK), n),
                torch.int32,
                ParamLayout(output_dim=1, input_dim=0, input_block=PACK),
            ),
            "qzeros": ((g, words), torch.int32, ParamLayout(1, in_dim, output_block=PACK, input_block=group)),
            "scales": ((g, n), torch.float16, ParamLayout(1, in_dim, input_block=group)),
            "g_idx": ((geo.cols,), torch.int32, ParamLayout(input_dim=0)),
        }

    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        group, _, _ = self.groups(geo)
        q = unpack_int32(tensors["qweight"], 0, geo.cols)
        zeros = unpack_shards(tensors["qzeros"], 1, geo.rows)
        if not self.v2:
            zeros = zeros + 1  # v1 stores zero - 1 (a zero of 0 reads as 16, as GPTQ's own kernels read it)
        return Unpacked(q, tensors["scales"], group, zeros, self._group_indices(tensors["g_idx"], geo))

    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        u, g_idx = self._write_groups(weight)
        zeros = u.zeros if u.zeros is not None else torch.full_like(u.scales, SYMMETRIC_ZERO, dtype=torch.uint8)
        stored = zeros.to(torch.int64) - (0 if self.v2 else 1)
        if g_idx is None:
            g_idx = (torch.arange(weight.shape[1]) // u.group_size).to(torch.int32)
        return {"qweight": pack_int32(u.q, 0), "qzeros": pack_int32(stored & 0xF, 1), "scales": u.scales,
                "g_idx": g_idx}  # fmt: skip


class PackQuantizedFormat(Int4Format):
    """compressed-tensors' ``pack-quantized`` format with 4-bit integer weights."""

    name = "compressed-tensors pack-quantized"

    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        group, g, cut = self.groups(geo)
        n, words = sum(geo.rows), sum(cdiv(r, PACK) for r in geo.rows)
        in_dim = 1 if cut else None
        specs: dict[str, ParamSpec] = {
            "weight_packed": ((n, cdiv(geo.cols, PACK)), torch.int32,
                              ParamLayout(output_dim=0, input_dim=1, input_block=PACK)),
            "weight_scale": ((n, g), torch.float32, ParamLayout(0, in_dim, input_block=group)),
            "weight_shape": ((len(geo.rows), 2), torch.int64, ParamLayout(per_shard=True)),
        }  # fmt: skip
        if self.zero_point:
            specs["weight_zero_point"] = ((words, g), torch.int32, ParamLayout(0, in_dim, output_block=PACK,
                                                                                input_block=group))  # fmt: skip
        if self.act_order:
            specs["weight_g_idx"] = ((geo.cols,), torch.int32, ParamLayout(input_dim=0))
        return specs

    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        group, _, _ = self.groups(geo)
        shapes = tensors["weight_shape"].tolist()
        if any(shape[1] != geo.full_cols for shape in shapes):
            raise ValueError(f"{self.name}: weight_shape {shapes} does not match the layer's {geo.full_cols} input "
                             "features")  # fmt: skip
        q = unpack_int32(tensors["weight_packed"], 1, geo.cols).t()
        zeros = None
        if self.zero_point:
            zeros = unpack_shards(tensors["weight_zero_point"], 0, geo.rows).t()
        g_idx = self._group_indices(tensors.get("weight_g_idx"), geo)
        return Unpacked(q.contiguous(), exact_16_bit(tensors["weight_scale"].t().contiguous()), group,
                        None if zeros is None else zeros.contiguous(), g_idx)  # fmt: skip

    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        u, g_idx = self._write_groups(weight)
        tensors = {"weight_packed": pack_int32(u.q.t(), 1), "weight_scale": u.scales.t().float(),
                   "weight_shape": torch.tensor(list(weight.shape))}  # fmt: skip
        if u.zeros is not None:
            tensors["weight_zero_point"] = pack_int32(u.zeros.t(), 0)
        if g_idx is not None:
            tensors["weight_g_idx"] = g_idx
        return tensors
