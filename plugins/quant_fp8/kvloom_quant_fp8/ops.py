"""fp8 (e4m3) quantization arithmetic, in torch: the CPU path, the format writer and the
reference of every kernel.

A quantized value is ``q = fp8(x / scale)`` (clamped to the e4m3 range, rounded to
nearest), its dequantized value ``q * scale``. Scales are float32 and ``amax / 448``:

* weights: one scale per tensor, per output channel (row) or per ``bo x bi`` block
  (DeepSeek-V3 / Qwen3-FP8: 128 x 128, stored as ``weight_scale_inv``, a multiplier
  despite its name);
* activations: dynamic, one scale per token (row) or per token and ``g`` consecutive
  features (1 x 128 groups for block-wise checkpoints), computed from the activation
  itself; or static, one scale for the tensor, from the checkpoint (``input_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvloom.interfaces import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: The smallest amax a scale is computed from (an all-zero row would divide by zero).
MIN_AMAX = 1e-12


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(x / scale)``, clamped to the e4m3 range (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale that maps ``amax`` to the largest fp8 value."""
    return amax.float().clamp(min=MIN_AMAX) / FP8_MAX


# ---------------------------------------------------------------------- activations


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(fp8 [..., K], float32 scales [..., 1])``, one scale per row."""
    scale = amax_scale(x.abs().amax(dim=-1, keepdim=True))
    return to_fp8(x, scale), scale


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., K]`` as ``[..., ceil(K / group), group]`` (the last group zero-padded)."""
    k = x.shape[-1]
    pad = cdiv(k, group) * group - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, group)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(fp8 [M, K], float32 scales [M, ceil(K / group)])``, one scale per
    row and ``group`` consecutive features."""
    k = x.shape[-1]
    g = _grouped(x.float(), group)
    scale = amax_scale(g.abs().amax(dim=-1, keepdim=True))
    q = to_fp8(g, scale).reshape(*x.shape[:-1], -1)[..., :k].contiguous()
    return q, scale.squeeze(-1).contiguous()


def fake_quantize_activation(x: torch.Tensor, kind: str | None, group: int = 128,
                             static_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` quantized to fp8 and dequantized again, in float32: ``kind`` ``"token"``
    (dynamic, per row), ``"group"`` (dynamic, per row and ``group`` features), ``"tensor"``
    (static, ``static_scale``), or ``None`` (weight-only: ``x`` unchanged)."""
    if kind is None:
        return x.float()
    if kind == "token":
        q, scale = quantize_per_token(x)
        return q.float() * scale
    if kind == "group":
        q, scale = quantize_per_token_group(x, group)
        return q.float() * scale.repeat_interleave(group, dim=-1)[..., : x.shape[-1]]
    if kind == "tensor":
        if static_scale is None:
            raise ValueError("static per-tensor activation quantization needs the checkpoint's input_scale")
        return to_fp8(x, static_scale).float() * static_scale.float()
    raise ValueError(f"activation quantization {kind!r}: allowed token, group, tensor, None")


# ---------------------------------------------------------------------- weights


def quantize_weight(
    weight: torch.Tensor, strategy: str, block: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float projection ``[out, in]`` -> ``(fp8 weight, float32 scale)``: the scale is
    ``()`` per ``"tensor"``, ``[out, 1]`` per ``"channel"``, ``[ceil(out/bo), ceil(in/bi)]`` per
    ``"block"`` (``block = (bo, bi)``)."""
    w = weight.float()
    if strategy == "tensor":
        scale = amax_scale(w.abs().amax())
        return to_fp8(w, scale), scale
    if strategy == "channel":
        scale = amax_scale(w.abs().amax(dim=1, keepdim=True))
        return to_fp8(w, scale), scale
    if strategy == "block":
        if block is None:
            raise ValueError("block-wise quantization needs a block size")
        bo, bi = block
        out, inp = w.shape
        padded = torch.nn.functional.pad(w, (0, cdiv(inp, bi) * bi - inp, 0, cdiv(out, bo) * bo - out))
        tiles = padded.reshape(cdiv(out, bo), bo, cdiv(inp, bi), bi)
        scale = amax_scale(tiles.abs().amax(dim=(1, 3)))
        return to_fp8(w, expand_block_scale(scale, out, inp, block)), scale
    raise ValueError(f"weight strategy {strategy!r}: allowed tensor, channel, block")


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: Sequence[int]) -> torch.Tensor:
    """``[ceil(rows/bo), ceil(cols/bi)]`` block scales -> one per element, ``[rows, cols]``."""
    bo, bi = block
    return scale.float().repeat_interleave(bo, dim=0)[:rows].repeat_interleave(bi, dim=1)[:, :cols]


def dequantize_shards(
    weight: torch.Tensor, scale: torch.Tensor, strategy: str, shard_sizes: Sequence[int],
    block: Sequence[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """A layer's fp8 ``weight [sum(shard_sizes), in]`` in float32, each shard (a merged
    layer's q/k/v, an expert's gate/up) with its own scales: ``scale [num_shards]`` per
    tensor, ``[rows, 1]`` per channel, per block ``[sum(ceil(n / bo)), ceil(in / bi)]`` with
    each shard starting on a block row of its own."""
    w = weight.float()
    if strategy == "channel":
        return w * scale.float()
    cols = w.shape[1]
    parts, row, block_row = [], 0, 0
    for index, n in enumerate(shard_sizes):
        rows = w[row : row + n]
        if strategy == "tensor":
            parts.append(rows * scale.reshape(-1)[index].float())
        elif strategy == "block":
            assert block is not None
            count = cdiv(n, block[0])
            parts.append(rows * expand_block_scale(scale[block_row : block_row + count], n, cols, block))
            block_row += count
        else:
            raise ValueError(f"weight strategy {strategy!r}: allowed tensor, channel, block")
        row += n
    return torch.cat(parts)
