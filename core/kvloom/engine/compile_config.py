"""The compilation section of the ``EngineConfig`` (``resolve_compilation``): whether
``torch.compile`` runs, the CUDA-graph mode and the capture sizes, from ``-O`` and the
explicit flags. ``-O`` levels only set defaults: explicit settings win, as in vLLM, whose
optimization levels never overwrite an explicit user setting.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvloom.config import CompilationConfig
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.worker.cudagraph_dispatcher import resolve_cudagraph_mode

if TYPE_CHECKING:
    from kvloom.attention.backend import AttentionBackend
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)


def _default_capture_sizes(max_num_seqs: int, max_size: int | None, max_num_tokens: int) -> list[int]:
    """vLLM's default list: 1, 2, 4, multiples of 8 below 256, then of 16, up to the max
    size (default ``min(2 * max_num_seqs, 512)``; at most ``max_num_tokens``)."""
    limit = min(max_size or min(2 * max_num_seqs, 512), max_num_tokens)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, min(limit, 255) + 1, 8))
    sizes += list(range(256, limit + 1, 16))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(set(sizes))


#: -O level -> (torch.compile where the platform compiles by default, cudagraph_mode).
OPTIMIZATION_LEVELS: dict[int, tuple[bool, CUDAGraphMode]] = {
    0: (False, CUDAGraphMode.NONE),
    1: (True, CUDAGraphMode.PIECEWISE),
    2: (True, CUDAGraphMode.FULL_AND_PIECEWISE),
    3: (True, CUDAGraphMode.FULL_AND_PIECEWISE),
}


def resolve_compilation(
    args: EngineArgs,
    platform: type[Platform],
    backend: type[AttentionBackend],
    max_num_batched_tokens: int,
    *,
    use_mla: bool = False,
) -> CompilationConfig:
    """The compilation section: ``-O`` defaults, then ``--enforce-eager``, then explicit
    flags (``--torch-compile``, ``--cudagraph-mode``, ``--custom-ops``) win; the mode is
    finally resolved against the platform, the compiled model and the backend's support."""
    level_compile, level_mode = OPTIMIZATION_LEVELS[args.optimization_level]
    compile_model = level_compile and platform.compile_by_default and not args.enforce_eager
    if args.torch_compile is not None:
        compile_model = args.torch_compile
    if compile_model and args.enable_lora:
        # LoRA layers read per-step adapter slots from the forward context, which a
        # compiled graph would bake in.
        if args.torch_compile:
            raise ValueError("torch_compile=True does not support enable_lora; drop one of them")
        logger.info("LoRA enabled: the model runs without torch.compile")
        compile_model = False
    if compile_model and use_mla:
        # MLAAttention calls its backends directly; it has no graph-splitting op yet.
        if args.torch_compile:
            raise ValueError("torch_compile=True does not support MLA models yet (DeepSeek); drop --torch-compile")
        logger.info("MLA model: it runs without torch.compile (not supported for MLA yet)")
        compile_model = False
    # Pipeline stages exchange IntermediateTensors around the forward; neither the compiled
    # graph nor the CUDA graphs carry that input and output yet.
    pipeline = args.pipeline_parallel_size > 1
    if pipeline and (compile_model or (args.cudagraph_mode not in (None, CUDAGraphMode.NONE))):
        if args.torch_compile or args.cudagraph_mode not in (None, CUDAGraphMode.NONE):
            raise ValueError(f"pipeline_parallel_size: {args.pipeline_parallel_size} runs eagerly (no torch.compile, "
                             "no CUDA graphs yet); drop --torch-compile / --cudagraph-mode")  # fmt: skip
        logger.info("Pipeline parallelism: the model runs eagerly (no torch.compile, no CUDA graphs)")
        compile_model = False
    requested = CUDAGraphMode.NONE if args.enforce_eager or pipeline else level_mode
    if args.cudagraph_mode is not None and not args.enforce_eager and not pipeline:
        requested = args.cudagraph_mode
    mode, reasons = resolve_cudagraph_mode(
        requested, backend.cudagraph_support, compile_model, platform.supports_cuda_graphs
    )
    if reasons:
        logger.info("cudagraph_mode %s -> %s: %s", requested.value, mode.value, "; ".join(reasons))
    if args.optimization_level > 0 and not compile_model and mode == CUDAGraphMode.NONE and not args.enforce_eager:
        # The levels choose torch.compile and CUDA graphs; where neither applies, say so
        # rather than let -O3 look faster than -O0.
        why = [] if platform.compile_by_default else [f"torch.compile is off by default on {platform.name} "
                                                      "(--torch-compile turns it on)"]  # fmt: skip
        why += [] if platform.supports_cuda_graphs else [f"{platform.name} has no CUDA graphs"]
        logger.info("-O%d runs the model eagerly here, as -O0 does%s", args.optimization_level,
                    f": {'; '.join(why)}" if why else "")  # fmt: skip
    custom_ops = args.custom_ops or ("none" if compile_model and args.use_inductor else "all")
    capture_sizes = args.cudagraph_capture_sizes or _default_capture_sizes(
        args.max_num_seqs, args.max_cudagraph_capture_size, max_num_batched_tokens
    )
    return CompilationConfig(
        optimization_level=args.optimization_level,
        enforce_eager=args.enforce_eager,
        compile_model=compile_model,
        use_inductor=args.use_inductor,
        splitting_ops=["kvloom::unified_attention", *backend.splitting_ops],
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[s for s in capture_sizes if s <= max_num_batched_tokens],
        custom_ops=custom_ops,
    )
