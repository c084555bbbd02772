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
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.quantization.selection import check_requested_quantization

if TYPE_CHECKING:
    import torch

    from kvloom.attention.backend import AttentionBackend, AttentionSelectorConfig
    from kvloom.config import CompilationConfig, EngineConfig, ModelConfig
    from kvloom.platforms.interface import Platform

# Only what EngineArgs needs is imported above: the CLI builds its flags from EngineArgs,
# and `kvloom --help` must not pay for importing torch. create_engine_config imports the
# engine's modules when it runs.

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

#: --dtype names -> the torch dtype's attribute name (``getattr(torch, ...)``).
DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
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
        None, description="Quantization method (vLLM's names): by default the checkpoint's quantization_config "
        "chooses it; a NAME such as fp8 quantizes an unquantized checkpoint while loading, or picks the method of a "
        "quantized one; 'none' runs the weights as stored (a GGUF file dequantized)."
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
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel ranks (worker processes on this machine, or Ray actors); must divide the model's "
        "num_attention_heads (Llama, Mistral, Qwen2, Qwen3 and their MoE variants)."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages (worker processes on this machine, times the tensor-parallel size), "
        "each with a contiguous run of the decoder layers; at most the model's num_hidden_layers (Llama, Mistral, "
        "Qwen2, Qwen3 and their MoE variants)."
    )
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None, description="How the workers run: uni (one worker in the engine core's process), mp (one process "
        "per rank on this machine) or ray (one Ray actor per rank, on the nodes of a Ray cluster; "
        "needs pip install ray); default: mp when --tensor-parallel-size or --pipeline-parallel-size > 1, else uni."
    )
    data_parallel_size: int = Field(
        1, ge=1, description="Model replicas, each an engine core process (one GPU each on CUDA; on the CPU they "
        "share the cores); requests go to the least loaded."
    )
    # ---- attention
    attention_backend: str | None = Field(
        None, description="Force an attention backend by NAME (for MLA models: the decode backend)."
    )
    mla_prefill_backend: str | None = Field(
        None, description="MLA models: force the prefill attention backend by NAME (default: by priority)."
    )
    # ---- compilation / CUDA graphs
    enforce_eager: bool = Field(False, description="No torch.compile and no CUDA graphs (explicit flags win).")
    optimization_level: int = Field(
        2, ge=0, le=3, description="-O0: eager; -O1: torch.compile + piecewise CUDA graphs; -O2/-O3: "
        "torch.compile + full decode graphs and piecewise graphs for the rest (FULL_AND_PIECEWISE)."
    )
    torch_compile: bool | None = Field(
        None, description="torch.compile the model (default: -O1 and above on platforms that compile by default: CUDA)."
    )
    use_inductor: bool = Field(True, description="Compile the pieces with Inductor (off: FX pieces, for debugging).")
    cudagraph_mode: CUDAGraphMode | None = Field(None, description="CUDA graph mode (default from -O).")
    cudagraph_capture_sizes: list[int] | None = Field(
        None, description="Token counts to capture graphs for (full decode graphs: those <= max_num_seqs)."
    )
    max_cudagraph_capture_size: int | None = Field(
        None, ge=1, description="Largest token count to capture (default min(2 x max_num_seqs, 512))."
    )
    custom_ops: Literal["all", "none"] | None = Field(
        None, description="Use the platform's fused layer kernels (all) or only torch ops (none); default: none "
        "when Inductor compiles the model (it fuses those ops itself), else all."
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
    import torch

    if requested != "auto":
        dtype = getattr(torch, DTYPES[requested])
        if dtype not in platform_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in platform_dtypes)
            raise ValueError(f"dtype: {requested} is not supported on platform {platform} (allowed: {allowed})")
        return dtype
    # "auto": the platform's preferred dtype, except that a half-precision checkpoint stays
    # in its own half type where the platform supports it and prefers half precision.
    preferred = platform_dtypes[0]
    # transformers >= 4.56 names it `dtype` (reading `torch_dtype` there logs a deprecation
    # warning); older versions only have `torch_dtype`.
    config_dtype = getattr(hf_config, "dtype", None)
    if config_dtype is None and "dtype" not in getattr(hf_config, "__dict__", {}):
        config_dtype = getattr(hf_config, "torch_dtype", None)
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


def _smallest_sliding_window(hf_config: object) -> int | None:
    """The smallest sliding window any layer uses (HF's ``sliding_window``,
    ``use_sliding_window``, ``layer_types``), or None."""
    from kvloom.models.llama import sliding_window_of

    text_config = getattr(hf_config, "text_config", None) or hf_config
    num_layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or not isinstance(getattr(text_config, "sliding_window", None), int):
        return None
    windows = [w for w in (sliding_window_of(text_config, i) for i in range(num_layers)) if w is not None]
    return min(windows, default=None)


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


def check_tensor_parallel(args: EngineArgs, model: ModelConfig) -> Literal["uni", "mp", "ray"]:
    """Validate ``--tensor-parallel-size`` and ``--pipeline-parallel-size`` against the
    model and the other flags; the executor backend (``--distributed-executor-backend``,
    default mp above one rank)."""
    from kvloom.models.registry import ModelRegistry

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    backend = args.distributed_executor_backend or ("mp" if tp * pp > 1 else "uni")
    if backend == "ray":
        from kvloom.executor.ray import import_ray

        import_ray()  # a clear error now, not when the engine core starts
    if tp * pp == 1:
        return backend
    if backend == "uni":
        field = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
        raise ValueError(f"distributed_executor_backend: 'uni' runs one worker, but {field} is {max(tp, pp)} "
                         f"(allowed with {field} > 1: mp, ray)")  # fmt: skip
    model_cls = ModelRegistry.load_model_cls(model.architecture)
    if pp > 1:
        check_pipeline_parallel(args, model, model_cls)
    if tp > 1:
        _check_tensor_parallel_size(args, model, model_cls)
    return backend


def check_pipeline_parallel(args: EngineArgs, model: ModelConfig, model_cls: type) -> None:
    """``--pipeline-parallel-size`` above 1: a model that splits its layers, at most one
    stage per layer, and none of the features that stages do not carry yet."""
    pp = args.pipeline_parallel_size
    if not getattr(model_cls, "supports_pipeline_parallel", False) or model.runner != "generate":
        raise ValueError(
            f"pipeline_parallel_size: {model.architecture} ({model.runner} runner) cannot be split into pipeline "
            "stages yet (allowed: 1); the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral generators can"
        )
    layers = int(getattr(model.hf_config, "num_hidden_layers", 0))
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size: {pp} stages for the model's {layers} layers "
                         f"(allowed: 1..{layers}, at least one layer per stage)")  # fmt: skip
    for flag, value, allowed in (
        ("async_scheduling", args.async_scheduling, False),
    ):
        if value != allowed:
            raise ValueError(f"{flag}: {value!r} is not supported with pipeline_parallel_size {pp} yet "
                             f"(allowed: {allowed!r}); the stages keep {pp} micro-batches in flight instead")  # fmt: skip
    _check_no_unsupported_features(args, f"pipeline_parallel_size {pp}")


def _check_tensor_parallel_size(args: EngineArgs, model: ModelConfig, model_cls: type) -> None:
    tp = args.tensor_parallel_size
    if not getattr(model_cls, "supports_tensor_parallel", False) or model.runner != "generate":
        raise ValueError(
            f"tensor_parallel_size: {model.architecture} ({model.runner} runner) has no tensor-parallel layers yet "
            f"(allowed: 1); the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral generators have"
        )
    if model.num_heads % tp != 0:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's num_attention_heads "
                         f"({model.num_heads}); allowed: a divisor of {model.num_heads}")  # fmt: skip
    kv = model.num_kv_heads
    if kv % tp != 0 and tp % kv != 0:
        raise ValueError(f"tensor_parallel_size: {tp} neither divides nor is a multiple of the model's "
                         f"num_key_value_heads ({kv})")  # fmt: skip
    # The dense MLPs' and the experts' (Qwen3-MoE: moe_intermediate_size) hidden sizes are split.
    for field in ("intermediate_size", "moe_intermediate_size"):
        intermediate = getattr(model.hf_config, field, None)
        if intermediate is not None and intermediate % tp != 0:
            raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {field} ({intermediate})")
    _check_no_unsupported_features(args, f"tensor_parallel_size {tp}")


def _check_no_unsupported_features(args: EngineArgs, what: str) -> None:
    for flag, value, allowed in (
        ("enable_lora", args.enable_lora, False),
        ("data_parallel_size", args.data_parallel_size, 1),
    ):
        if value != allowed:
            raise ValueError(f"{flag}: {value!r} is not supported with {what} yet (allowed: {allowed!r})")


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
    from kvloom.config import CompilationConfig
    from kvloom.worker.cudagraph_dispatcher import resolve_cudagraph_mode

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


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve ``args`` into the ``EngineConfig`` every component receives (see the
    module docstring for the order)."""
    from kvloom import plugins
    from kvloom.attention.backend import DEFAULT_BLOCK_SIZE
    from kvloom.attention.selector import select_attention_backend
    from kvloom.config import (
        AttentionConfig,
        CacheConfig,
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
    from kvloom.quantization.selection import quantization_for_engine

    plugins.load_plugins()
    platform = plugins.current_platform()

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
    window = _smallest_sliding_window(hf_config)
    if window is not None and window < derived_len:
        # kvloom's attention backends have no sliding-window masks yet (models/llama.py): a
        # longer context would attend past the window. vLLM's habit when it cannot honour
        # the window: cap the context to it.
        if args.max_model_len is None:
            logger.warning(
                "The model uses sliding-window attention (%d tokens), which kvloom does not implement yet: "
                "max_model_len is capped at %d instead of the model's %d (set --max-model-len <= %d).",
                window, window, derived_len, window,
            )  # fmt: skip
        elif args.max_model_len > window:
            raise ValueError(
                f"max_model_len: {args.max_model_len} is longer than the model's sliding window of {window} tokens, "
                f"which kvloom does not implement yet (allowed: 1..{window}); pass --max-model-len {window} or less"
            )
        derived_len = window
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
        quantization=quantization_for_engine(
            hf_config, args.quantization, platform, dtype, tensor_parallel_size=args.tensor_parallel_size,
            gguf=source.kind == "gguf", model=source.path,
        ),
    )
    executor_backend = check_tensor_parallel(args, model)
    if args.trust_remote_code:
        logger.info("--trust-remote-code: kvloom runs no code from model repositories; the flag changes nothing")

    kv_cache_dtype = args.kv_cache_dtype
    selector = _selector_config(platform, model, kv_cache_dtype, args.block_size)
    selection = select_attention_backend(platform, selector, requested=args.attention_backend)
    backend = selection.selected
    prefill_backend = None
    if model.use_mla:
        # MLA models get a second backend for the prefill phase, chosen the same way; it
        # never owns the cache, so the decode backend's block size stands.
        prefill_selector = _selector_config(platform, model, kv_cache_dtype, selection.block_size, "prefill")
        prefill_backend = select_attention_backend(
            platform, prefill_selector, requested=args.mla_prefill_backend
        ).selected
        logger.info("MLA backends: decode %s, prefill %s", backend.NAME, prefill_backend.NAME)
    elif args.mla_prefill_backend is not None:
        raise ValueError(
            f"mla_prefill_backend={args.mla_prefill_backend!r}: model {architecture} does not use MLA "
            "(only MLA models, e.g. DeepSeek-V2/V3, have a separate prefill backend)"
        )
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
        # Without chunking, a whole prompt must fit into one step. A smaller budget the user
        # set is refused rather than silently raised (vLLM refuses it too).
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {args.max_num_batched_tokens} is smaller than max_model_len "
                f"({max_model_len}); with chunked prefill off (--no-enable-chunked-prefill) a whole prompt must fit "
                f"into one step: set --max-num-batched-tokens >= {max_model_len} or lower --max-model-len"
            )
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
    compilation = resolve_compilation(args, platform, backend, max_batched, use_mla=model.use_mla)

    config = EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                distributed_executor_backend=executor_backend,
                                data_parallel_size=args.data_parallel_size),  # fmt: skip
        attention=AttentionConfig(
            requested_backend=args.attention_backend,
            backend=backend,
            requested_prefill_backend=args.mla_prefill_backend,
            prefill_backend=prefill_backend,
        ),
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
    platform: type, model: ModelConfig, kv_cache_dtype: str, block_size: int | None, mla_phase: str = "decode"
) -> AttentionSelectorConfig:
    """The selection config of the model's attention; for an MLA model, of one phase
    (``mla_phase``): decode over the latent rows (one KV head of ``kv_lora_rank +
    qk_rope_head_dim``), prefill over decompressed per-head K/V."""
    from kvloom.attention.backend import AttentionSelectorConfig

    if model.use_mla:
        dims = model.mla_dims
        decode = mla_phase == "decode"
        return AttentionSelectorConfig(
            head_size=dims.latent_size if decode else dims.qk_head_dim,
            dtype=model.dtype,
            kv_cache_dtype=kv_cache_dtype,
            # The prefill phase never reads the paged cache (the core decompresses the
            # cached prefix for it), so its block sizes do not matter.
            block_size=block_size if decode else None,
            use_mla=True,
            mla_phase=mla_phase,
            v_head_dim=None if decode else dims.v_head_dim,
            device_type=platform.device_type,
            device_capability=platform.get_device_capability(),
            num_heads=dims.num_heads,
            num_kv_heads=1 if decode else dims.num_heads,
        )
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
def fixed_fields() -> tuple[tuple[str, str], ...]:
    from kvloom.config import ModelConfig

    return (
        *(("model", f) for f in ModelConfig.model_fields if f != "max_model_len"),
        ("attention", "requested_backend"),
        ("attention", "backend"),
        ("attention", "requested_prefill_backend"),
        ("attention", "prefill_backend"),
        ("device", "platform"),
        ("device", "device_type"),
    )


def _fixed_fields(config: EngineConfig) -> dict[str, object]:
    return {f"{section}.{field}": getattr(getattr(config, section), field) for section, field in fixed_fields()}


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
    prefill = config.attention.prefill_backend
    if prefill is not None:
        prefill_selector = _selector_config(
            config.device.platform, config.model, config.cache.cache_dtype, config.cache.block_size, "prefill"
        )
        prefill_reasons = prefill.validate_configuration(prefill_selector)
        reasons += [f"(MLA prefill backend {prefill.NAME}) {r}" for r in prefill_reasons]
    if reasons:
        raise ValueError(
            f"EngineConfig: after the {who}, attention backend {backend.NAME} cannot serve the adjusted config: "
            + "; ".join(reasons)
        )
