"""What the CUDA platform offers as custom ops (``CudaPlatform.custom_ops``): the fused
layer kernels for 16-bit models only, the MoE kernels (``fused_moe``) and the sampler's
``random_sample`` for every dtype, the Triton LoRA kernel (``lora_delta``) for every
dtype whenever LoRA is enabled. (The kernels themselves: test_fused_ops.py and
test_lora_ops.py.)"""

from __future__ import annotations

import pytest
from kvloom_platform_cuda import fused_moe, fused_ops, lora_ops, sampling
from kvloom_platform_cuda.platform import CudaPlatform

from kvloom.interfaces import CUSTOM_OP_SIGNATURES
from kvloom.testing import resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir

FUSED = {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_qk", "qk_norm_rotary"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("enable_lora", [False, True])
def test_lora_kernel_is_offered_for_every_dtype_when_lora_is_on(dtype, enable_lora):
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype=dtype, enable_lora=enable_lora)
    ops = CudaPlatform.custom_ops(config)
    assert set(ops) <= set(CUSTOM_OP_SIGNATURES)
    assert (set(ops) & FUSED) == (set() if dtype == "float32" else FUSED)
    assert ("lora_delta" in ops) == enable_lora
    if enable_lora:
        assert ops["lora_delta"] is lora_ops.lora_delta
    if dtype != "float32":
        assert ops["silu_and_mul"] is fused_ops.silu_and_mul
    # Every dtype: the torch MoE path reads group sizes on the host (no CUDA graphs).
    assert ops["fused_moe"] is fused_moe.fused_moe
    # Every dtype: the sampler always runs.
    assert ops["random_sample"] is sampling.random_sample
