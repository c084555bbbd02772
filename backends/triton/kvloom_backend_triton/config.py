"""Launch parameters of the Triton kernels: a fixed heuristic table plus overrides.

No runtime autotuning: on a fresh machine every autotune candidate costs a JIT compile
per layer shape, which is more than a short benchmark or a first request can afford.
Instead a small table keyed by (padded head size, element size) picks the tiles, and
``KVLOOM_TRITON_ATTN_CONFIG`` (``"decode_block_n=32,decode_num_warps=8"``) or an explicit
``KernelConfig`` overrides any field, so variants can be compared in one GPU session.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvloom.interfaces import check_launch_fields, next_power_of_2, parse_kernel_overrides, resolve_kernel_config

ENV_VAR = "KVLOOM_TRITON_ATTN_CONFIG"


@dataclass(frozen=True)
class KernelConfig:
    """Tiles, warps and pipeline depths of the three attention kernels.

    prefill_*: the mixed-batch kernel (one program = up to ``prefill_block_m`` rows, each
    row one (query token, query head) of a single KV head; ``prefill_block_n`` cached
    tokens per inner step). decode_*: the single-token decode kernel (one program = one
    request x one KV head x one KV split). The split count aims at ``programs_per_sm``
    decode programs per streaming multiprocessor, never splitting below
    ``min_split_tokens`` tokens per split nor beyond ``max_splits`` splits.
    ``force_num_splits`` pins the split count (tests and benchmarks).
    """

    prefill_block_m: int = 128
    prefill_block_n: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 3
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    programs_per_sm: int = 4
    min_split_tokens: int = 256
    max_splits: int = 64
    force_num_splits: int | None = None

    def __post_init__(self) -> None:
        check_launch_fields(
            self, tiles=("prefill_block_m", "prefill_block_n", "decode_block_n"),
            warps=("prefill_num_warps", "decode_num_warps"), stages=("prefill_num_stages", "decode_num_stages"),
            positive=("programs_per_sm", "min_split_tokens", "max_splits", "force_num_splits"),
        )  # fmt: skip

    def with_overrides(self, overrides: dict[str, int | None]) -> KernelConfig:
        return dataclasses.replace(self, **overrides)


def default_config(head_size: int, dtype: torch.dtype, arch: int | None = None) -> KernelConfig:
    """The heuristic table (sized for Hopper, sane on Ampere and newer); ``arch``: the
    device's compute capability as ``10 * major + minor`` (None: not known, the tiles that
    fit every supported GPU).

    Register pressure grows with rows x padded head size (the fp32 accumulator) and shared
    memory with tokens x head size x stages (K and V tiles in flight), so larger heads and
    4-byte elements get smaller tiles. Decode is bandwidth bound: 64 tokens x 128 dims of
    bf16 is a 16 KiB K tile, three stages of K and V keep ~96 KiB of loads in flight per
    program.
    """
    padded = next_power_of_2(head_size)
    wide = dtype == torch.float32
    if padded <= 64:
        cfg = KernelConfig(prefill_block_m=128, prefill_block_n=64, prefill_num_warps=4,
                           decode_block_n=64, decode_num_warps=4)
    elif padded <= 128:
        # Hopper: prefill_block_n 128 over 64: a 512-token chunk after 3,584 cached tokens
        # took 99 instead of 115 us, 8 x 2048 prompts 303 instead of 295 TFLOP/s (H100,
        # 2026-11-26, bench_attention_steps.py / bench_attention_kernels.py). Before Hopper
        # (mma.sync, no wgmma) that tile spills registers.
        cfg = KernelConfig(prefill_block_m=128, prefill_block_n=128 if (arch or 0) >= 90 else 64,
                           prefill_num_warps=8, decode_block_n=64, decode_num_warps=4)
    else:  # 256
        cfg = KernelConfig(prefill_block_m=64, prefill_block_n=32, prefill_num_warps=8,
                           prefill_num_stages=2, decode_block_n=32, decode_num_warps=4)
    if wide:
        # fp32 dots run as "ieee" FMA loops (no tensor cores) and hold 4-byte operands in
        # registers: larger tiles spill (checked with aot_check for sm_90).
        cfg = cfg.with_overrides(
            {
                "prefill_block_m": 32,
                "prefill_block_n": 16,
                "prefill_num_warps": 8,
                "prefill_num_stages": 2,
                "decode_block_n": 16,
                "decode_num_stages": 2,
            }
        )
    return cfg


def parse_overrides(text: str) -> dict[str, int | None]:
    """``"a=1,b=2"`` -> ``{"a": 1, "b": 2}`` for fields of ``KernelConfig`` (``KVLOOM_TRITON_ATTN_CONFIG``'s syntax)."""
    return parse_kernel_overrides(text, KernelConfig, ENV_VAR)


def resolve_config(
    head_size: int,
    dtype: torch.dtype,
    override: KernelConfig | dict[str, int | None] | None = None,
    arch: int | None = None,
) -> KernelConfig:
    """The table's entry, then ``KVLOOM_TRITON_ATTN_CONFIG``, then ``override``."""
    if isinstance(override, KernelConfig):
        return override
    return resolve_kernel_config(default_config(head_size, dtype, arch), ENV_VAR, override)
