"""MXFP4 weights (OCP microscaling: e2m1 values, one e8m0 power-of-two scale per 32
input features) as two checkpoint formats store them, per projection ``[N, K]``:

* **gpt-oss** (``quant_method: mxfp4``): ``*_blocks`` uint8 ``[N, K/32, 16]`` (the 32
  values of a block in 16 bytes, value ``2b`` in the low nibble of byte ``b``) and
  ``*_scales`` uint8 ``[N, K/32]`` (``scale = 2 ** (e - 127)``); the experts of a layer
  stacked (``experts.gate_up_proj_blocks [E, 2I, H/32, 16]``, ``experts.down_proj_blocks``);
* **compressed-tensors** ``mxfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K/2]``
  (the same nibble order) and ``weight_scale`` uint8 ``[N, K/32]`` (the same exponents).

Both read into ``kvloom_quant_int4.packing.Unpacked`` (e2m1 codes, group 32), which the
4-bit kernels and the CPU path of ``kvloom-quant-int4`` run. A ``K`` that is not a
multiple of 32 ends in a partial block, padded with zeros.
"""

from __future__ import annotations

import torch
from kvloom_quant_int4.formats import Geometry, ParamSpec, exact_16_bit
from kvloom_quant_int4.packing import Unpacked, pack_bytes, quantize_mxfp4, unpack_bytes

from kvloom.interfaces import ParamLayout, cdiv

#: Input features per scale.
BLOCK = 32


def read_mxfp4(packed: torch.Tensor, exponents: torch.Tensor, k: int) -> Unpacked:
    """Bytes ``[N, >= K/2]`` (two e2m1 values each, low nibble first) and e8m0 exponents
    ``[N, ceil(K/32)]`` -> ``Unpacked``."""
    codes = unpack_bytes(packed.reshape(packed.shape[0], -1), k)
    scales = exact_16_bit(torch.exp2(exponents.float() - 127))
    return Unpacked(codes.t().contiguous(), scales.t().contiguous(), BLOCK, e2m1=True)


def write_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` -> ``(bytes [N, ceil(K/32) * 16], e8m0 [N, ceil(K/32)])``."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, cdiv(k, BLOCK) * BLOCK - k))
    codes, exponents = quantize_mxfp4(padded)
    return pack_bytes(codes), exponents


class Mxfp4Format:
    """compressed-tensors' ``mxfp4-pack-quantized`` (``weight_packed``, ``weight_scale``)."""

    name = "compressed-tensors mxfp4-pack-quantized"

    def describe(self) -> str:
        return f"{self.name}: MXFP4 weights (e2m1, e8m0 scales per {BLOCK})"

    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        n, blocks = sum(geo.rows), cdiv(geo.cols, BLOCK)
        return {
            "weight_packed": ((n, cdiv(geo.cols, 2)), torch.uint8, ParamLayout(0, 1, input_block=2)),
            "weight_scale": ((n, blocks), torch.uint8, ParamLayout(0, 1, input_block=BLOCK)),
        }

    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        return read_mxfp4(tensors["weight_packed"], tensors["weight_scale"], geo.cols)

    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, exponents = write_mxfp4(weight)
        return {"weight_packed": packed[:, : cdiv(weight.shape[1], 2)].contiguous(), "weight_scale": exponents}


class GptOssFormat:
    """gpt-oss's ``*_blocks`` / ``*_scales`` (one expert's projection)."""

    name = "mxfp4 (gpt-oss)"

    def describe(self) -> str:
        return f"{self.name}: MXFP4 experts (e2m1, e8m0 scales per {BLOCK})"

    def params(self, geo: Geometry) -> dict[str, ParamSpec]:
        n, blocks = sum(geo.rows), cdiv(geo.cols, BLOCK)
        return {
            "blocks": ((n, blocks, BLOCK // 2), torch.uint8, ParamLayout(0, 1, input_block=BLOCK)),
            "scales": ((n, blocks), torch.uint8, ParamLayout(0, 1, input_block=BLOCK)),
        }

    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked:
        return read_mxfp4(tensors["blocks"], tensors["scales"], geo.cols)

    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, exponents = write_mxfp4(weight)
        return {"blocks": packed.reshape(weight.shape[0], -1, BLOCK // 2), "scales": exponents}
