"""The layout the 4-bit kernels read, built once at load from any format's ``Unpacked``.

``W4Tensors`` (one projection, or with a leading experts dim the experts of a layer):

* ``qweight`` int32 ``[K, ceil(N / 8)]``: the codes packed along the output features,
  value ``n`` of row ``k`` in nibble ``n % 8`` of word ``n // 8`` (so a kernel tile of
  ``BLOCK_N`` outputs reads ``BLOCK_N / 8`` consecutive words of each row);
* ``scales`` ``[G, N]`` in the checkpoint's scale dtype (float16 for AWQ/GPTQ; the model
  dtype for compressed-tensors; MXFP4's e8m0 exponents become exact powers of two);
* ``zeros`` uint8 ``[G, N]``, or ``None`` (symmetric integers: 8; e2m1: none);
* act-order: the input features sorted by group, ``perm [K]`` (row ``k`` of ``qweight``
  is input feature ``perm[k]``: the kernels gather the activation's columns through it)
  and ``gidx [K]`` (the group of row ``k``), or ``None`` (groups are runs of ``group_size``).

``dequantize`` reads it back in torch: the reference of the kernels and the weight the
CPU path computes with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom_quant_int4.packing import Unpacked, pack_int32, unpack_int32

#: The layer parameters holding a ``W4Tensors`` (prefixed ``w13_`` / ``w2_`` for experts).
FIELDS = ("qweight", "scales", "zeros", "perm", "gidx")


@dataclass
class W4Tensors:
    """4-bit weights in the kernels' layout (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    gidx: torch.Tensor | None
    group_size: int
    """Input features per group (when ``gidx`` is None)."""
    n: int
    """Output features (``qweight`` may hold up to 7 more, zero)."""
    e2m1: bool = False
    """The codes are e2m1 (MXFP4), not integers."""

    @property
    def k(self) -> int:
        return self.qweight.shape[-2]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-empty fields by name."""
        return {name: t for name in FIELDS if (t := getattr(self, name)) is not None}


def to_kernel_layout(u: Unpacked) -> W4Tensors:
    """One projection's ``Unpacked`` -> ``W4Tensors`` (act-order features sorted by group)."""
    perm = gidx = None
    q = u.q
    if u.g_idx is not None:
        perm = torch.argsort(u.g_idx, stable=True)
        q = q[perm]
        gidx = u.g_idx[perm].to(torch.int32).contiguous()
        perm = perm.to(torch.int32).contiguous()
    zeros = None if u.zeros is None else u.zeros.to(torch.uint8).contiguous()
    return W4Tensors(pack_int32(q, 1), u.scales.contiguous(), zeros, perm, gidx, u.group_size, q.shape[1], u.e2m1)


def stack_experts(parts: list[W4Tensors]) -> W4Tensors:
    """The experts' layouts of one projection stacked along a leading dim."""
    first = parts[0]

    def stacked(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"experts disagree on whether they have {name} (act-order or zero points)")
        return torch.stack(values)

    return W4Tensors(stacked("qweight"), stacked("scales"), stacked("zeros"), stacked("perm"),  # type: ignore[arg-type]
                     stacked("gidx"), first.group_size, first.n, first.e2m1)  # fmt: skip


def expert(w: W4Tensors, index: int) -> W4Tensors:
    """Expert ``index`` of stacked experts."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]

    return W4Tensors(w.qweight[index], w.scales[index], pick(w.zeros), pick(w.perm), pick(w.gidx), w.group_size, w.n,
                     w.e2m1)  # fmt: skip


def dequantize(w: W4Tensors) -> torch.Tensor:
    """float32 ``[N, K]`` of one projection, input features in the checkpoint's order."""
    q = unpack_int32(w.qweight, 1, w.n)
    sorted_weight = Unpacked(q, w.scales, w.group_size, w.zeros, w.gidx, w.e2m1).dequantize()
    if w.perm is None:
        return sorted_weight
    out = torch.empty_like(sorted_weight)
    out[:, w.perm.long()] = sorted_weight
    return out
