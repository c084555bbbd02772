"""Faster kernels for layer math, supplied by the platform.

Every layer computes with plain torch ops, which is correct everywhere but launches many
small kernels (a Llama-3-8B decode step runs ~1,200 of them; each costs a few
microseconds even inside a CUDA graph). A platform may supply fused replacements for the
ops named in ``OP_SIGNATURES`` through ``Platform.custom_ops(config)``; the model loader
activates them for the model it builds (``--custom-ops none`` keeps the torch code, for
every op: the LoRA update too).

Contract for a replacement: same signature, new output tensors (inputs untouched), and
the torch code's results for the dtypes the platform enables it for: bit-identical for
``silu_and_mul``, ``rotary_qk`` and the residual sum of ``fused_add_rms_norm``; the norms
within 2 ulp in float16/bfloat16 (the squares may be summed in another order) and 1e-5
relative in float32; ``qk_norm_rotary``, a norm and a rotation, within
``QK_NORM_ROTARY_TOLERANCES`` (``kvloom.testing.custom_ops``) of its torch code, relative
to the largest value (the norm's ulps carried through the rotation). ``lora_delta`` and
``fused_moe`` are the exceptions: ``fused_moe`` (grouped GEMMs over the experts) matches
its float64 definition to the dtype's tolerance, as its torch code does. ``lora_delta``:
it may add the update to ``y`` in place (the layer's fresh output) and return it, and it
sums in another order than the grouped torch GEMMs (fp32 accumulation, rounded once), so
it matches the float64 definition to the dtype's tolerance, not bit for bit.
``random_sample`` (the sampler's, not a layer's) is a random draw, so its contract is
distributional: greedy rows exactly the torch code's argmax, and over many calls each
sampled row's token frequencies those of ``softmax(logits / temperature)``; its draws
need not (and cannot) match the torch code's. The torch code of each op is
``kvloom.testing.custom_op_reference(name)`` and ``kvloom.testing.check_custom_op`` checks
a replacement against this contract. Layers (and the sampler) call
``get_custom_op(name)`` on every forward, so the active set is per process: one engine
per process, as the engine core runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

#: The ops a platform may replace, with the call each layer makes.
OP_SIGNATURES: dict[str, str] = {
    "rms_norm": "(x, weight, eps) -> normed; RMSNorm of the last dimension, HF's rounding",
    "fused_add_rms_norm": "(x, residual, weight, eps) -> (normed, x + residual)",
    "silu_and_mul": "(x [.., 2d]) -> silu(x[.., :d]) * x[.., d:]",
    "rotary_qk": "(x [N, heads, D], cos [N, 1, D/2], sin [N, 1, D/2]) -> rotated contiguous copy",
    "qk_norm_rotary": "(x [N, heads, D], q_weight [D], k_weight [D], num_q_heads, eps, cos [N, 1, D/2], "
    "sin [N, 1, D/2]) -> contiguous [N, heads, D]: each head RMS-normalised (q_weight on the first num_q_heads, "
    "k_weight on the rest), then rotated as rotary_qk (Qwen3's q_norm / k_norm before RoPE)",
    "lora_delta": "(x [T, in], y [T, out], lora_a [S, R, in], lora_b [S, out, R], mapping: LoRAMapping) -> y plus "
    "each token's (x @ A[slot].T) @ B[slot].T (kvloom.lora.ops; may update y in place)",
    "fused_moe": "(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] int32) "
    "-> [T, H]: sum over each token's k experts of weight * w2[e] @ silu_and_mul(w13[e] @ x) "
    "(kvloom.layers.fused_moe)",
    "random_sample": "(logits [B, V] float (any float dtype, rows may be strided), temperature [B] float32, "
    "greedy [B] bool or None) -> [B] int64: per row argmax(logits) where greedy, else one draw from "
    "softmax(logits / temperature) (kvloom.sample.sampler)",
}

_active: dict[str, Callable[..., object]] = {}


def set_custom_ops(ops: Mapping[str, Callable[..., object]]) -> None:
    """Activate ``ops`` (replacing any earlier set); unknown names are an error."""
    unknown = sorted(set(ops) - set(OP_SIGNATURES))
    if unknown:
        raise ValueError(f"unknown custom op(s) {unknown}; known: {sorted(OP_SIGNATURES)}")
    for name, fn in ops.items():
        if not callable(fn):
            raise TypeError(f"custom op {name!r} must be callable, got {type(fn).__name__}")
    _active.clear()
    _active.update(ops)
    if ops:
        logger.info("Custom ops: %s", ", ".join(sorted(ops)))


def get_custom_op(name: str) -> Callable[..., object] | None:
    """The active replacement for ``name``, or None (use the torch code)."""
    return _active.get(name)
