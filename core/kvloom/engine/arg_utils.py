"""``EngineArgs``, the user's flat options, and ``create_engine_config``, which resolves them.

``EngineArgs`` holds the keyword arguments of ``LLM`` and the flags of ``kvloom serve`` /
``generate``, named as vLLM users type them. It is a pydantic model: an invalid value
raises a ``ValidationError`` naming the field and the allowed values.

``create_engine_config(args)`` makes the ``EngineConfig`` (``kvloom.config``). The order
matters and is the same in every process: load plugins (so out-of-tree models and
backends are registered), pick the platform, read the model's config, settle dtype and
max_model_len, select the attention backend (which may choose the block size), settle the
CUDA-graph mode (NONE on a platform without ``supports_cuda_graphs``), let the platform
adjust the result, then the general plugins' ``kvloom_update_engine_config`` hook.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloom import plugins
from kvloom.attention.backend import DEFAULT_BLOCK_SIZE, AttentionSelectorConfig
from kvloom.attention.selector import select_attention_backend
from kvloom.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from kvloom.loader.generation_config import generation_defaults, resolve_chat_template
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from kvloom.models.registry import ModelRegistry
from kvloom.quantization import check_checkpoint_quantization, check_requested_quantization

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

DTypeName = Literal["auto", "float32", "float", "float16", "half", "bfloat16"]
LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash"]


def parse_memory_size(value: int | str) -> int:
    """Bytes from an int or a string like "4GiB", "512MiB", "2G", "1e9"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a memory size: {value!r} (examples: 4GiB, 512MiB, 1000000000)")
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(number * scale)


class EngineArgs(BaseModel):
    """All user-facing engine options, flat. CLI flags are these names with dashes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # ---- model
    model: str | None = Field(None, description="HF directory, .gguf file, or None for the default SmolLM2.")
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the model's).")
    skip_tokenizer_init: bool = Field(False, description="Serve token ids only; no tokenizer files needed.")
    served_model_name: str | None = Field(None, description="Model name reported by the API.")
    dtype: DTypeName = Field("auto", description="Weight and activation dtype.")
    max_model_len: int | None = Field(None, ge=1, description="Max prompt + output tokens per request.")
    seed: int = Field(0, ge=0, description="Seed for weight init (dummy) and unseeded sampling.")
    load_format: LoadFormat = Field("auto", description="How to load weights; 'dummy' makes random weights.")
    trust_remote_code: bool = Field(False, description="Accepted for compatibility; kvloom runs no remote code.")
    chat_template: str | None = Field(
        None, description="Chat template to use instead of the tokenizer's: a Jinja file or the template inline."
    )
    generation_config: str = Field(
        "auto", description="Default sampling parameters: 'auto' reads the model's generation_config.json, "
        "'vllm' (or 'kvloom') ignores it, or a folder holding one."
    )
    max_logprobs: int = Field(20, ge=0, le=20, description="The most logprobs a request may ask per token (0..20).")
    quantization: str | None = Field(
        None, description="Weight quantization method; none is supported yet (only the default, no quantization)."
    )
    runner: Literal["auto", "generate", "pooling"] = Field("auto", description="Generate text or pool embeddings.")
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = Field(None, description="Pooling for embeddings.")
    normalize: bool | None = Field(None, description="L2-normalise embeddings (default: yes).")
    io_processor_plugin: str | None = Field(None, description="IO processor plugin name (pooling models).")
    # ---- cache
    block_size: int | None = Field(None, ge=1, le=4096, description="Tokens per KV block (default: backend's choice).")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Fraction of GPU memory to use.")
    kv_cache_memory: int | str | None = Field(None, description="KV-cache bytes (e.g. 4GiB); overrides the fraction.")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="Force the number of KV blocks.")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="KV cache dtype.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    prefix_caching_hash_algo: HashAlgo = Field("sha256", description="Block hash algorithm.")
    # ---- scheduler
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Max requests per step.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Max tokens per step.")
    long_prefill_token_threshold: int = Field(0, ge=0, description="Cap per-request prefill chunk (0 = off).")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="Queue order.")
    async_scheduling: bool = Field(
        False, description="Schedule step n+1 while step n runs on the device (overlaps host work)."
    )
    # ---- parallel
    tensor_parallel_size: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    data_parallel_size: int = Field(
        1, ge=1, description="Model replicas, each an engine core process (one GPU each on CUDA; on the CPU they "
        "share the cores); requests go to the least loaded."
    )
    # ---- attention
    attention_backend: str | None = Field(None, description="Force an attention backend by NAME.")
    # ---- compilation / CUDA graphs
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")
    optimization_level: int = Field(2, ge=0, le=3, description="-O0..-O3 defaults.")
    cudagraph_mode: CUDAGraphMode | None = Field(None, description="CUDA graph mode (default from -O).")
    cudagraph_capture_sizes: list[int] | None = Field(None, description="Decode batch sizes to capture.")
    max_cudagraph_capture_size: int | None = Field(None, ge=1, description="Largest decode batch to capture.")
    custom_ops: Literal["all", "none"] = Field(
        "all", description="Use the platform's fused layer kernels (all) or only torch ops (none)."
    )
    # ---- LoRA
    enable_lora: bool = Field(False, description="Allow LoRA adapters.")
    max_loras: int = Field(1, ge=1, le=256, description="Max adapters in one batch.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="Max adapter rank.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters kept loaded (default max_loras).")
    lora_modules: dict[str, str] | None = Field(None, description="name=path adapters to preload.")
    # ---- structured outputs
    structured_outputs_backend: str = Field(
        "xgrammar", description="Structured-output (guided decoding) backend: xgrammar or a plugin's name."
    )
    # ---- observability
    # The one default of stats for LLM, kvloom generate/chat/serve/bench (LLM has none of its own).
    disable_log_stats: bool = Field(
        False, description="Turn engine stats off: no periodic stats line, no stat logger plugins, no engine metrics."
    )
    log_stats_interval: float = Field(
        5.0, gt=0.0, description="Seconds (> 0) between stats summaries (the stat loggers' log()); once more at shutdown."
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, v: int | str | None) -> int | None:
        if v is None:
            return None
        n = parse_memory_size(v)
        if n <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return n

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, v: str | None) -> str | None:
        return check_requested_quantization(v)

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _capture_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if any(s < 1 for s in v):
            raise ValueError("cudagraph_capture_sizes must be positive batch sizes")
        return sorted(set(v))

    @model_validator(mode="after")
    def _check(self) -> "EngineArgs":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to get one token per step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        return self


# ---------------------------------------------------------------------- resolution


def _resolve_dtype(requested: str, hf_config: object, platform_dtypes: tuple[torch.dtype, ...], platform: str) -> torch.dtype:
    if requested != "auto":
        dtype = DTYPES[requested]
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
    """Resolve ``args`` into the ``EngineConfig`` every component receives (see the
    module docstring for the order)."""
    plugins.load_plugins()
    platform = plugins.current_platform()

    source = resolve_model_source(args.model, args.load_format, tokenizer=args.tokenizer)
    hf_config = load_hf_config(source)
    check_checkpoint_quantization(hf_config, source.path)
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
        chat_template=resolve_chat_template(args.chat_template),
        generation_defaults=generation_defaults(args.generation_config, source.path),
        max_logprobs=args.max_logprobs,
    )
    if args.trust_remote_code:
        logger.info("--trust-remote-code: kvloom runs no code from model repositories; the flag changes nothing")

    kv_cache_dtype = args.kv_cache_dtype
    selector = _selector_config(platform, model, kv_cache_dtype, args.block_size)
    selection = select_attention_backend(platform, selector, requested=args.attention_backend)
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

    # -O levels only set defaults; explicit settings win (as in vLLM: its optimization
    # levels never overwrite an explicit user setting).
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
    if mode != CUDAGraphMode.NONE and not platform.supports_cuda_graphs:
        logger.info(
            "cudagraph_mode %s: platform %s does not support CUDA graphs; running eagerly (NONE).",
            mode.value,
            platform.name,
        )
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
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                data_parallel_size=args.data_parallel_size),  # fmt: skip
        attention=AttentionConfig(requested_backend=args.attention_backend, backend=backend),
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
        device=DeviceConfig(platform=platform, device_type=platform.device_type),
        structured_outputs=StructuredOutputsConfig(backend=args.structured_outputs_backend),
    )
    resolved = _fixed_fields(config)
    platform.check_and_update_config(config)
    _check_adjusted(config, resolved, f"check_and_update_config of platform {platform.name}", derived_len)
    plugins.call_update_engine_config(config)
    _check_adjusted(config, resolved, "general plugins' kvloom_update_engine_config hooks", derived_len)
    if config.parallel.data_parallel_size > 1:  # now, naming the flag, if the machine cannot hold the replicas
        for index in range(config.parallel.data_parallel_size):
            platform.data_parallel_env(index, config.parallel.data_parallel_size)
    # What the engine runs with, after the platform and the hooks.
    logger.info(
        "kvloom config: model=%s served_model_name=%s arch=%s dtype=%s max_model_len=%d platform=%s device=%s "
        "backend=%s block_size=%d",
        Path(config.model.model).name,
        config.model.served_model_name,
        config.model.architecture,
        str(config.model.dtype).removeprefix("torch."),
        config.model.max_model_len,
        platform.name,
        platform.get_device_name(),
        config.attention.backend.NAME,
        config.cache.block_size,
    )
    return config


def _selector_config(
    platform: type, model: ModelConfig, kv_cache_dtype: str, block_size: int | None
) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(
        head_size=model.head_size,
        dtype=model.dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        use_mla=False,
        device_type=platform.device_type,
        device_capability=platform.get_device_capability(),
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
    )


#: (section, field) that a platform's check_and_update_config and the general plugins'
#: kvloom_update_engine_config must leave as resolved: the model (but its max_model_len),
#: the selected attention backend, the platform.
FIXED_FIELDS: tuple[tuple[str, str], ...] = (
    *(("model", f) for f in ModelConfig.model_fields if f != "max_model_len"),
    ("attention", "requested_backend"),
    ("attention", "backend"),
    ("device", "platform"),
    ("device", "device_type"),
)


def _fixed_fields(config: EngineConfig) -> dict[str, object]:
    return {f"{section}.{field}": getattr(getattr(config, section), field) for section, field in FIXED_FIELDS}


def _check_adjusted(config: EngineConfig, resolved: dict[str, object], who: str, max_len: int) -> None:
    """Refuse what ``who`` left in ``config`` that the engine cannot run: a changed fixed
    field, max_model_len out of step or range, a block size or KV-cache dtype the selected
    backend does not serve."""

    def same(a: object, b: object) -> bool:
        if a is b:
            return True
        try:
            return bool(a == b)
        except Exception:
            return False

    changed = [name for name, value in _fixed_fields(config).items() if not same(value, resolved[name])]
    if changed:
        raise ValueError(
            f"EngineConfig: the {who} changed {', '.join(changed)}, which must not change once resolved "
            "(the model, the attention backend and the platform are fixed; see docs/plugins.md, 'The engine config')"
        )
    model_len, scheduler_len = config.model.max_model_len, config.scheduler.max_model_len
    if model_len != scheduler_len:
        raise ValueError(
            f"EngineConfig: after the {who}, model.max_model_len ({model_len}) and scheduler.max_model_len "
            f"({scheduler_len}) must be equal (change both)"
        )
    if model_len > max_len:
        raise ValueError(
            f"EngineConfig: after the {who}, max_model_len {model_len} exceeds the model's maximum of {max_len}"
        )
    backend = config.attention.backend
    selector = _selector_config(config.device.platform, config.model, config.cache.cache_dtype, config.cache.block_size)
    reasons = backend.validate_configuration(selector)
    if reasons:
        raise ValueError(
            f"EngineConfig: after the {who}, attention backend {backend.NAME} cannot serve the adjusted config: "
            + "; ".join(reasons)
        )
