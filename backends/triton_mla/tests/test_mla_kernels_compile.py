"""The MLA kernels compile for Hopper (sm_90) without a GPU, within its resources.

The interpreter accepts programs the GPU compiler rejects and says nothing about registers
or shared memory: this compiles the decode (with and without splits), reduce and prefill
kernels with the default tiles for DeepSeek's shapes (latent 512 + 64, prefill 192 / 128)
and checks for spills, the shared-memory limit and 16-byte latent loads. Uses TRITON_ATTN's
compile helper (kvloom_backend_triton.aot_check), a test-only dependency.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
aot = pytest.importorskip("kvloom_backend_triton.aot_check")

from kvloom_backend_triton_mla import decode_kernels, ops, prefill_kernels  # noqa: E402

from kvloom.interfaces import min_split_tiles

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(_PTXAS), reason="Triton's bundled ptxas is not installed")

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _strides(fn) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    return tuple(n for n in fn.arg_names if n.startswith("stride"))


def _check(rep) -> None:  # type: ignore[no-untyped-def]
    assert rep.spill_bytes == 0, rep.row()
    assert rep.shared_bytes <= aot.SMEM_LIMITS[90], rep.row()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["one_split", "split"])
def test_decode_compiles_for_sm90(dtype: torch.dtype, split: bool) -> None:
    cfg = ops.default_config(dtype)
    t = _TYPES[dtype]
    io = {"q_nope_ptr": f"*{t}", "q_pe_ptr": f"*{t}", "kv_cache_ptr": f"*{t}", "out_ptr": f"*{t}",
          "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "qk_scale": "fp32"}
    constexprs = dict(KV_LORA_RANK=512, ROPE_DIM=64, PAGE_SIZE=64, NUM_SPLITS=8 if split else 1,
                      BLOCK_H=cfg.decode_block_h, BLOCK_N=cfg.decode_block_n, BLOCK_L=512, BLOCK_R=64, SPLIT=split,
                      MIN_SPLIT_TILES=min_split_tiles(cfg.min_split_tokens, cfg.decode_block_n, None),
                      DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    rep = aot.compile_kernel(decode_kernels.mla_decode_kernel, io, constexprs, 90, cfg.decode_num_warps,
                             cfg.decode_num_stages, divisible=_strides(decode_kernels.mla_decode_kernel))
    _check(rep)
    assert rep.vector_loads > 0, f"latent loads are not 16 bytes wide: {rep.row()}"


def test_reduce_compiles_for_sm90() -> None:
    fn = decode_kernels.mla_decode_reduce_kernel
    rep = aot.compile_kernel(fn, {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "out_ptr": "*bf16"},
                             dict(KV_LORA_RANK=512, NUM_SPLITS=16, BLOCK_L=512), 90, 4, 1, divisible=_strides(fn))
    _check(rep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefill_compiles_for_sm90(dtype: torch.dtype) -> None:
    cfg = ops.default_config(dtype)
    t = _TYPES[dtype]
    fn = prefill_kernels.varlen_causal_attention_kernel
    io = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "out_ptr": f"*{t}", "qk_scale": "fp32"}
    constexprs = dict(QK_DIM=192, V_DIM=128, BLOCK_M=cfg.prefill_block_m, BLOCK_N=cfg.prefill_block_n,
                      BLOCK_DQK=256, BLOCK_DV=128, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    rep = aot.compile_kernel(fn, io, constexprs, 90, cfg.prefill_num_warps, cfg.prefill_num_stages,
                             divisible=_strides(fn))
    _check(rep)
