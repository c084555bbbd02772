"""The torch code of each custom op (``kvloom.layers.custom_ops``): what the layers compute
when no platform op replaces it, and what a replacement is held to. Its own module: it
imports the layers, which import ``custom_ops``."""

from __future__ import annotations

from typing import Any

from kvloom.layers.custom_ops import OP_SIGNATURES


def custom_op_reference(name: str) -> Any:
    """The torch code that the custom op ``name`` (a key of
    ``kvloom.interfaces.CUSTOM_OP_SIGNATURES``) replaces: what the layers compute with
    ``--custom-ops none``, with the op's own signature. ``rms_norm`` and
    ``fused_add_rms_norm`` are ``RMSNorm``'s, ``silu_and_mul`` is ``SiluAndMul``'s,
    ``rotary_qk`` is ``RotaryEmbedding.rotate_heads``', ``qk_norm_rotary`` Qwen3's
    ``q_norm``/``k_norm`` and rotation (``LlamaAttention``), ``lora_delta`` the grouped LoRA
    GEMMs (its float64 definition is ``lora_delta_reference``) and ``fused_moe`` the
    per-expert GEMMs of ``FusedMoE`` (float64 definition: ``fused_moe_reference``) and
    ``random_sample`` the sampler's temperature sampling (``random_sample_torch``: a random
    draw, whose distribution ``check_custom_op`` compares). Run it on the device and in
    the dtype your op runs in: ``check_custom_op`` compares the two. An op may also hand
    inputs it does not take (another dtype, say) to this code: one engine sets its ops per
    process, but layers built outside an engine (a test's) may meet them."""
    from kvloom.layers.activation import silu_and_mul_torch
    from kvloom.layers.fused_moe import fused_moe_torch
    from kvloom.layers.layernorm import fused_add_rms_norm_torch, rms_norm_torch
    from kvloom.layers.rotary import qk_norm_rotary_torch, rotary_qk_torch
    from kvloom.lora.ops import lora_delta_torch
    from kvloom.sample.sampler import random_sample_torch

    references = {
        "rms_norm": rms_norm_torch,
        "fused_add_rms_norm": fused_add_rms_norm_torch,
        "silu_and_mul": silu_and_mul_torch,
        "rotary_qk": rotary_qk_torch,
        "qk_norm_rotary": qk_norm_rotary_torch,
        "lora_delta": lora_delta_torch,
        "fused_moe": fused_moe_torch,
        "random_sample": random_sample_torch,
    }
    if name not in OP_SIGNATURES or name not in references:
        raise ValueError(f"unknown custom op {name!r} (known: {', '.join(sorted(OP_SIGNATURES))})")
    return references[name]
