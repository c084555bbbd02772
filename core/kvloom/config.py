"""Engine configuration.

``EngineArgs`` is the flat, user-facing set of options (the keyword arguments of ``LLM``
and the flags of ``kvloom serve``/``generate``, named as vLLM users type them). It is a
pydantic model: an invalid value raises a ``ValidationError`` naming the field and the
allowed values. ``EngineArgs.create_engine_config()`` resolves it (plugins, platform,
model files, dtype, max_model_len, attention backend, block size) into an
``EngineConfig`` made of sections that every component receives whole.
"""

from __future__ import annotations

import enum
import logging
import re
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from kvloom.attention.backend import AttentionBackend
    from kvloom.platform import Platform

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

DTypeName = Literal["auto", "float32", "float", "float16", "half", "bfloat16"]
LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash"]


class CUDAGraphMode(str, enum.Enum):
    """vLLM's cudagraph_mode values. kvloom has no piecewise compilation, so the
    PIECEWISE parts of a mode run eagerly (documented in docs/cuda_graphs.md)."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"


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
    # ---- observability
    disable_log_stats: bool = Field(False, description="Do not log stats periodically.")
    log_stats_interval: float = Field(5.0, gt=0.0, description="Seconds between stat log lines.")

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, v: int | str | None) -> int | None:
        if v is None:
            return None
        n = parse_memory_size(v)
        if n <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return n

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

    def create_engine_config(self) -> "EngineConfig":
        from kvloom.config_resolve import create_engine_config

        return create_engine_config(self)


# ---------------------------------------------------------------------- resolved sections


class _Section(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), validate_assignment=True)


class ModelConfig(_Section):
    model: str  # the path that was loaded (HF directory or .gguf file), or the user's string
    tokenizer: str | None
    skip_tokenizer_init: bool
    served_model_name: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int
    runner: Literal["generate", "pooling"]
    pooling_type: str = "LAST"
    normalize: bool = True
    io_processor_plugin: str | None = None

    def _text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def num_layers(self) -> int:
        return self._text_config().num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self._text_config().num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        c = self._text_config()
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_size(self) -> int:
        c = self._text_config()
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def hidden_size(self) -> int:
        return self._text_config().hidden_size

    @property
    def vocab_size(self) -> int:
        return self._text_config().vocab_size


class CacheConfig(_Section):
    block_size: int
    user_specified_block_size: bool
    gpu_memory_utilization: float
    kv_cache_memory: int | None
    num_gpu_blocks_override: int | None
    cache_dtype: str
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    num_blocks: int | None = None  # set once the worker has sized the cache


class SchedulerConfig(_Section):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int
    enable_chunked_prefill: bool
    policy: Literal["fcfs", "priority"]
    async_scheduling: bool = False


class ParallelConfig(_Section):
    tensor_parallel_size: int = 1
    worker_cls: str | None = None  # qualified name, set from the platform


class AttentionConfig(_Section):
    backend: str | None  # the user's choice (None = by priority)
    selected_backend: str = ""  # what selection picked


class LoadConfig(_Section):
    load_format: str
    #: "hf" (config.json + safetensors/bin), "gguf", or "dummy" (random weights)
    source_kind: str = "hf"


class CompilationConfig(_Section):
    optimization_level: int
    enforce_eager: bool
    cudagraph_mode: CUDAGraphMode
    cudagraph_capture_sizes: list[int]
    custom_ops: Literal["all", "none"] = "all"


class LoRAConfig(_Section):
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_modules: dict[str, str] = Field(default_factory=dict)


class ObservabilityConfig(_Section):
    disable_log_stats: bool
    log_stats_interval: float


class DeviceConfig(_Section):
    platform: str  # name of the active platform
    device_type: str


class EngineConfig(_Section):
    """The resolved configuration every component receives."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    attention: AttentionConfig
    load: LoadConfig
    compilation: CompilationConfig
    lora: LoRAConfig
    observability: ObservabilityConfig
    device: DeviceConfig

    @property
    def platform(self) -> type["Platform"]:
        from kvloom.registry import get_platform_by_name

        return get_platform_by_name(self.device.platform)

    @property
    def attention_backend(self) -> type["AttentionBackend"]:
        from kvloom.registry import get_attention_backend

        return get_attention_backend(self.attention.selected_backend)


def resolve_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
