"""Resolve ``EngineArgs`` into an ``EngineConfig``.

Order matters and is the same in every process: load plugins (so out-of-tree models and
backends are registered), pick the platform, read the model's config, settle dtype and
max_model_len, select the attention backend (which may choose the block size), then let
the platform adjust the result.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvloom.attention.backend import AttentionSelectorConfig
from kvloom.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def _resolve_dtype(requested: str, hf_config: object, platform_dtypes: tuple[torch.dtype, ...], platform: str) -> torch.dtype:
    if requested != "auto":
        dtype = resolve_dtype(requested)
        if dtype not in platform_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in platform_dtypes)
            raise ValueError(f"dtype: {requested} is not supported on platform {platform} (allowed: {allowed})")
        return dtype
    # "auto": the platform's preferred dtype, except that a half-precision checkpoint stays
    # in its own half type where the platform supports it and prefers half precision.
    preferred = platform_dtypes[0]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if preferred != torch.float32 and config_dtype in (torch.float16, torch.bfloat16) and config_dtype in platform_dtypes:
        return config_dtype
    return preferred


def _derived_max_model_len(hf_config: object) -> int:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _default_capture_sizes(max_num_seqs: int, max_size: int | None) -> list[int]:
    """vLLM's default list: 1, 2, 4, then multiples of 8 up to the max size."""
    limit = min(max_size or 512, max_num_seqs)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(set(sizes))


def create_engine_config(args: EngineArgs) -> EngineConfig:
    from kvloom import registry
    from kvloom.loader.model_source import load_hf_config, resolve_model_source
    from kvloom.models.registry import ModelRegistry

    registry.load_plugins()
    platform = registry.current_platform()

    source = resolve_model_source(args.model, args.load_format, tokenizer=args.tokenizer)
    hf_config = load_hf_config(source)
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = ModelRegistry.resolve_architecture(architectures, model=source.path)

    dtype = _resolve_dtype(args.dtype, hf_config, platform.supported_dtypes, platform.name)
    derived_len = _derived_max_model_len(hf_config)
    if args.max_model_len is not None and args.max_model_len > derived_len:
        raise ValueError(
            f"max_model_len: {args.max_model_len} exceeds the model's maximum of {derived_len} "
            f"(allowed: 1..{derived_len})"
        )
    max_model_len = args.max_model_len or derived_len

    runner = args.runner
    if runner == "auto":
        runner = "pooling" if ModelRegistry.is_pooling_architecture(architecture) else "generate"

    model = ModelConfig(
        model=source.path,
        tokenizer=source.tokenizer_path,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=args.served_model_name or source.display_name,
        hf_config=hf_config,
        architecture=architecture,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        runner=runner,
        pooling_type=args.pooling_type or "LAST",
        normalize=True if args.normalize is None else args.normalize,
        io_processor_plugin=args.io_processor_plugin or getattr(hf_config, "io_processor_plugin", None),
    )

    kv_cache_dtype = args.kv_cache_dtype
    capability = platform.get_device_capability()
    selector = AttentionSelectorConfig(
        head_size=model.head_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=args.block_size,
        use_mla=False,
        device_type=platform.device_type,
        device_capability=capability,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
    )
    selection = registry.select_attention_backend(platform, selector, requested=args.attention_backend)
    backend = selection.selected
    # Block-size negotiation (docs/attention_backends.md): a user's --block-size was part
    # of the selection config, so every candidate that cannot serve it was already
    # invalid; without one, selection validated the backends without a block size and
    # the chosen backend decides it.
    block_size = selection.block_size
    if args.block_size is None and block_size != DEFAULT_BLOCK_SIZE:
        logger.info(
            "Block size %d chosen by attention backend %s (it supports %s); set --block-size to override.",
            block_size,
            backend.NAME,
            backend.describe_block_sizes(),
        )

    cache = CacheConfig(
        block_size=block_size,
        user_specified_block_size=args.block_size is not None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,  # already bytes after validation
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        cache_dtype=kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
    )

    if args.enable_chunked_prefill:
        max_batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    else:
        # Without chunking, a whole prompt must fit into one step.
        max_batched = max(args.max_num_batched_tokens or 0, max_model_len, args.max_num_seqs)
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
    )

    # -O levels only set defaults; explicit settings win (the seeds' rule).
    if args.cudagraph_mode is not None:
        mode = args.cudagraph_mode
    elif args.enforce_eager or args.optimization_level == 0:
        mode = CUDAGraphMode.NONE
    elif args.optimization_level == 1:
        mode = CUDAGraphMode.PIECEWISE
    else:
        mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if args.enforce_eager:
        mode = CUDAGraphMode.NONE
    capture_sizes = args.cudagraph_capture_sizes or _default_capture_sizes(
        args.max_num_seqs, args.max_cudagraph_capture_size
    )
    compilation = CompilationConfig(
        optimization_level=args.optimization_level,
        enforce_eager=args.enforce_eager,
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[s for s in capture_sizes if s <= args.max_num_seqs],
        custom_ops=args.custom_ops,
    )

    config = EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        attention=AttentionConfig(backend=args.attention_backend, selected_backend=backend.NAME),
        load=LoadConfig(load_format=args.load_format, source_kind=source.kind),
        compilation=compilation,
        lora=LoRAConfig(
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras or args.max_loras,
            lora_modules=args.lora_modules or {},
        ),
        observability=ObservabilityConfig(
            disable_log_stats=args.disable_log_stats, log_stats_interval=args.log_stats_interval
        ),
        device=DeviceConfig(platform=platform.name, device_type=platform.device_type),
    )
    platform.check_and_update_config(config)
    logger.info(
        "kvloom config: model=%s arch=%s dtype=%s max_model_len=%d platform=%s backend=%s block_size=%d",
        Path(model.model).name,
        architecture,
        str(dtype).removeprefix("torch."),
        max_model_len,
        platform.name,
        backend.NAME,
        block_size,
    )
    return config
