"""Compile the kernels for a GPU target without a GPU, and report their resources.

``python -m kvloom_backend_triton.aot_check [--arch 90] [--head-sizes 64,128,256]``
compiles the decode, reduce, mixed-batch and cache-write kernels with the launch
parameters the heuristic table picks, for each dtype and head size, and prints shared
memory, registers and spills (from ``ptxas -v``) and whether K/V loads are 16 bytes wide.
It catches what the CPU interpreter cannot: kernels that do not compile for the GPU, or
tiles that spill or exceed shared memory. Costs ~2 s of CPU per kernel variant.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvloom.interfaces import min_split_tiles
from kvloom_backend_triton import kernels
from kvloom_backend_triton.config import KernelConfig, default_config, next_power_of_2
from kvloom_backend_triton.ops import MIN_DOT_ROWS, NO_FEATURES, LayerFeatures, mixed_batch_tiles

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
#: Shared memory a block may use on Hopper (227 KiB); Ampere A100 has 163 KiB.
SMEM_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass
class CompileReport:
    kernel: str
    variant: str
    shared_bytes: int
    registers: int
    spill_bytes: int
    vector_loads: int
    num_warps: int

    def row(self) -> str:
        return (
            f"{self.kernel:<10} {self.variant:<44} smem {self.shared_bytes / 1024:6.1f} KiB  "
            f"regs {self.registers:4d}  spills {self.spill_bytes:5d} B  16B-loads {self.vector_loads:4d}  "
            f"warps {self.num_warps}"
        )


def _signature(fn: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*i32")
        else:
            sig[name] = types.get(name, "i32")
    return sig


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    text = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", text))
    return regs, spills


def compile_kernel(
    fn: triton.JITFunction,
    types: dict[str, str],
    constexprs: dict[str, object],
    arch: int,
    num_warps: int,
    num_stages: int,
    divisible: tuple[str, ...] = (),
) -> CompileReport:
    """Compile ``fn`` for ``sm_<arch>``; arguments named in ``divisible`` (and every
    pointer) are declared 16-aligned, as Triton's launcher would for aligned values."""
    sig = _signature(fn, types, constexprs)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name in divisible
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    regs, spills = _ptxas_report(compiled.asm["ptx"], arch)
    ptx = compiled.asm["ptx"]
    # 16-byte global reads: vector loads into registers, or async copies into shared memory.
    vector_loads = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)) + len(
        re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], 0x10\b", ptx)
    )
    return CompileReport(
        kernel=fn.__name__.replace("_attention_kernel", "").replace("_kernel", ""),
        variant="",
        shared_bytes=compiled.metadata.shared,
        registers=regs,
        spill_bytes=spills,
        vector_loads=vector_loads,
        num_warps=num_warps,
    )


_STRIDES = (
    "stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_cache_block",
    "stride_cache_slot", "stride_cache_head", "stride_bt_req", "stride_part_row", "stride_part_head",
    "stride_lse_row", "stride_key_tok", "stride_key_head", "stride_value_tok", "stride_value_head",
)


def check_configuration(
    dtype: torch.dtype,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int = 16,
    arch: int = 90,
    cfg: KernelConfig | None = None,
    max_query_len: int = 2048,
    features: LayerFeatures = NO_FEATURES,
) -> list[CompileReport]:
    """Compile every kernel one model shape uses (decode with and without splits), with the
    sliding-window / soft-cap / sinks specialization ``features`` selects, as a launch would."""
    cfg = cfg or default_config(head_size, dtype, arch)
    t = _TRITON_TYPES[dtype]
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_size)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    io = {"q_ptr": f"*{t}", "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "out_ptr": f"*{t}",
          "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "slot_mapping_ptr": "*i64",
          "key_ptr": f"*{t}", "value_ptr": f"*{t}", "key_cache_ptr": f"*{t}", "value_cache_ptr": f"*{t}",
          "sinks_ptr": f"*{t}", "qk_scale": "fp32", "soft_cap": "fp32"}
    flags = features.constexprs()
    on = "+".join(name.lower() for name, value in flags.items() if value)
    label = f"{_TRITON_TYPES[dtype]} D={head_size} G={group} page={block_size}" + (f" {on}" if on else "")
    reports = []
    common = {"GROUP": group, "PAGE_SIZE": block_size, "HEAD_SIZE": head_size, "BLOCK_D": block_d,
              "DOT_PRECISION": precision, **flags}
    for split in (False, True):
        rep = compile_kernel(
            kernels.decode_attention_kernel, io,
            {**common, "BLOCK_G": max(MIN_DOT_ROWS, next_power_of_2(group)), "BLOCK_N": cfg.decode_block_n,
             "SPLIT": split,
             "MIN_SPLIT_TILES": min_split_tiles(cfg.min_split_tokens, cfg.decode_block_n, cfg.force_num_splits)},
            arch, cfg.decode_num_warps, cfg.decode_num_stages, divisible=_STRIDES,
        )
        rep.variant = f"{label} N={cfg.decode_block_n} split={split}"
        reports.append(rep)
    rep = compile_kernel(
        kernels.decode_reduce_kernel, io,
        {"HEAD_SIZE": head_size, "BLOCK_S": 16, "BLOCK_D": block_d, "SINKS": flags["SINKS"]},
        arch, 4, 1, divisible=_STRIDES,
    )
    rep.variant = f"{label} S=16"
    reports.append(rep)
    block_m, block_q = mixed_batch_tiles(group, max_query_len, cfg)
    rep = compile_kernel(
        kernels.mixed_batch_attention_kernel, io,
        {**common, "BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_N": cfg.prefill_block_n, "SKIP_SINGLE": True},
        arch, cfg.prefill_num_warps, cfg.prefill_num_stages, divisible=_STRIDES,
    )
    rep.variant = f"{label} M={block_m} N={cfg.prefill_block_n}"
    reports.append(rep)
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    rep = compile_kernel(
        kernels.write_kv_kernel, io,
        {"PAGE_SIZE": block_size, "HEAD_SIZE": head_size, "BLOCK_H": block_h, "BLOCK_D": block_d},
        arch, 4, 1, divisible=_STRIDES,
    )
    rep.variant = f"{label} H={block_h}"
    reports.append(rep)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--head-sizes", default="64,128,256")
    parser.add_argument("--heads", default="32,8", help="num_heads,num_kv_heads")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--all-features", action="store_true",
                        help="compile the sliding-window + soft-cap + sinks specialization")
    args = parser.parse_args()
    num_heads, num_kv_heads = (int(x) for x in args.heads.split(","))
    features = NO_FEATURES
    if args.all_features:
        # Only the flags matter to the compiler; the values are never read here.
        features = LayerFeatures(sliding_window=1, logits_soft_cap=1.0, sinks=torch.zeros(num_heads))
    limit = SMEM_LIMITS.get(args.arch)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for head_size in (int(x) for x in args.head_sizes.split(",")):
            for rep in check_configuration(
                dtype, head_size, num_heads, num_kv_heads, args.block_size, args.arch, features=features
            ):
                flag = "  OVER SMEM LIMIT" if limit and rep.shared_bytes > limit else ""
                print(rep.row() + flag)


if __name__ == "__main__":
    main()
