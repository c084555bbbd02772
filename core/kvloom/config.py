"""The resolved engine configuration: ``EngineConfig`` and its sections.

Every component receives the whole ``EngineConfig``. It is made once, when the engine
starts, by ``kvloom.engine.arg_utils.create_engine_config`` from the user's flat
``EngineArgs``; that is also where the active platform and the attention backend are
chosen, and their classes are kept here (``device.platform``, ``attention.backend``) so
that nothing looks them up by name again.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvloom.attention.backend import AttentionBackend
from kvloom.platforms.interface import Platform

class CUDAGraphMode(str, enum.Enum):
    """vLLM's cudagraph_mode values. kvloom has no piecewise compilation, so the
    PIECEWISE parts of a mode run eagerly (documented in docs/cuda_graphs.md)."""

    NONE = "NONE"
    """No CUDA graphs: every step runs eagerly."""
    PIECEWISE = "PIECEWISE"
    """Piecewise graphs (vLLM); kvloom runs them eagerly."""
    FULL = "FULL"
    """Full graphs; kvloom captures uniform decode batches, the rest runs eagerly."""
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    """Full graphs of uniform decode batches; everything else eagerly."""
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"
    """Full graphs for decode, piecewise for the rest (kvloom: the rest eagerly)."""


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


class AttentionConfig(_Section):
    requested_backend: str | None  # the user's --attention-backend (None = by priority)
    backend: type[AttentionBackend]  # what selection picked


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
    log_stats_interval: float = Field(gt=0.0)


class DeviceConfig(_Section):
    platform: type[Platform]  # the active platform
    device_type: str


class EngineConfig(_Section):
    """The resolved configuration every component receives."""

    model: ModelConfig
    """The model: path, ``hf_config``, ``architecture``, ``dtype``, ``max_model_len``, the
    resolved ``num_layers`` / ``num_heads`` / ``num_kv_heads`` / ``head_size`` /
    ``hidden_size`` / ``vocab_size``, ``served_model_name``, ``runner``, pooling settings."""
    cache: CacheConfig
    """The KV cache: ``block_size``, ``cache_dtype``, memory budget, prefix caching,
    ``num_blocks`` (once the worker sized the cache)."""
    scheduler: SchedulerConfig
    """Batching: ``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill, policy,
    async scheduling."""
    parallel: ParallelConfig
    """Parallelism (``tensor_parallel_size``, 1 today)."""
    attention: AttentionConfig
    """``backend``: the selected ``AttentionBackend`` class; ``requested_backend``: the
    user's ``--attention-backend``."""
    load: LoadConfig
    """Weight loading: ``load_format`` and the source kind (``hf``, ``gguf``, ``dummy``)."""
    compilation: CompilationConfig
    """CUDA graphs (``cudagraph_mode``, ``cudagraph_capture_sizes``, ``enforce_eager``) and
    ``custom_ops`` (``"all"`` or ``"none"``)."""
    lora: LoRAConfig
    """LoRA: ``enable_lora``, ``max_loras``, ``max_lora_rank``, ``lora_modules``."""
    observability: ObservabilityConfig
    """Stats logging: ``disable_log_stats``, ``log_stats_interval``."""
    device: DeviceConfig
    """``platform``: the active ``Platform`` class; ``device_type``."""
