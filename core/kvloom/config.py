"""The resolved engine configuration: ``EngineConfig`` and its sections.

Every component receives the whole ``EngineConfig``. It is made once, when the engine
starts, by ``kvloom.engine.config_builder.create_engine_config`` from the user's flat
``EngineArgs``; that is also where the active platform and the attention backend are
chosen, and their classes are kept here (``device.platform``, ``attention.backend``) so
that nothing looks them up by name again.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvloom.attention.backend import AttentionBackend
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.deprecation import Deprecation, deprecated_property
from kvloom.kv_transfer.config import KVTransferConfig
from kvloom.platforms.interface import Platform
from kvloom.quantization.method import QuantizationMethod

# ---------------------------------------------------------------------- resolved sections


class _Section(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), validate_assignment=True)


class ModelConfig(_Section):
    """The model: where it came from, its HF config and the numbers resolved from it.

    Fixed once resolved: a platform's ``check_and_update_config`` and the general plugins'
    ``kvloom_update_engine_config`` must not change these fields (the engine refuses to
    start if they do), except ``max_model_len``, which they may lower together with
    ``scheduler.max_model_len``. Model classes read them (``config.model.head_size``, ...)."""

    model: str
    """The path that was loaded: the HF directory or the ``.gguf`` file (absolute)."""
    tokenizer: str | None
    """Directory or ``.gguf`` file of the tokenizer (default: the model's)."""
    skip_tokenizer_init: bool
    """No tokenizer: prompts are token ids and outputs carry no text."""
    served_model_name: str
    """The model's name in the API (reported as ``model`` in responses, first in
    ``/v1/models``, the startup line, stat loggers, what LoRA resolvers receive): the first
    ``--served-model-name``, else the model argument as given (vLLM's rule:
    ``kvloom serve /srv/models/Llama-3.2-1B`` -> ``/srv/models/Llama-3.2-1B``, ``org/name``
    -> ``org/name``), or ``SmolLM2-135M-Instruct`` for the default model."""
    served_model_names: list[str] = Field(default_factory=list)
    """Every name requests may use for the model (``--served-model-name a b``), starting
    with ``served_model_name``; each is listed by ``/v1/models``. Empty (a config built by
    hand): ``served_model_name`` alone."""
    hf_config: Any  # transformers.PretrainedConfig
    """The checkpoint's ``transformers.PretrainedConfig`` (from ``config.json``, or converted
    from GGUF metadata); a model reads its own fields from it."""
    architecture: str
    """The ``architectures`` entry of the checkpoint that selected the model class."""
    dtype: torch.dtype
    """The dtype weights and activations run in (``--dtype``; ``auto`` resolved by the
    platform's ``supported_dtypes``)."""
    max_model_len: int = Field(ge=1)
    """The longest sequence (prompt + output) of a request; at most the model's maximum.
    Equal to ``scheduler.max_model_len``."""
    seed: int = Field(ge=0)
    """Seed of dummy weights and of requests without a seed of their own."""
    runner: Literal["generate", "pooling"]
    """``generate`` (text, through the LM head) or ``pooling`` (embeddings of the hidden
    states)."""
    pooling_type: str = "LAST"
    """Pooling runs: ``LAST``, ``MEAN`` or ``CLS``."""
    normalize: bool = True
    """Pooling runs: L2-normalise the pooled vectors."""
    io_processor_plugin: str | None = None
    """The IO processor plugin to run (``--io-processor-plugin``, else ``config.json``'s
    ``io_processor_plugin``), or None."""
    chat_template: str | None = None
    """The chat template to use instead of the tokenizer's (``--chat-template``, the text
    of the file or the inline template), or None for the tokenizer's own."""
    generation_defaults: dict[str, Any] = Field(default_factory=dict)
    """Default sampling parameters of requests that leave them unset (``--generation-config``:
    the model's ``generation_config.json`` by default): SamplingParams names (temperature,
    top_p, top_k, min_p, repetition_penalty, max_tokens)."""
    max_logprobs: int = Field(20, ge=0)
    """The most logprobs a request may ask per token (``--max-logprobs``)."""
    quantization: QuantizationMethod | None = None
    """The quantization method that runs the weights (built from the checkpoint's
    ``quantization_config``, or ``--quantization``; ``kvloom.quantization.selection``), or
    None: the weights run as stored (a GGUF file dequantized). Layers get their part of
    it while the model is built (``kvloom.quantization.context``)."""

    def _text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def text_config(self) -> Any:
        """The HF config of the text model: ``hf_config.text_config`` of a multimodal
        checkpoint (Gemma 3's ``Gemma3ForConditionalGeneration``), else ``hf_config``."""
        return self._text_config()

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers`` of the (text) config."""
        return self._text_config().num_hidden_layers

    @property
    def num_heads(self) -> int:
        """Query heads per layer: ``num_attention_heads``."""
        return self._text_config().num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer: ``num_key_value_heads``, else ``num_attention_heads``."""
        c = self._text_config()
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_size(self) -> int:
        """``head_dim`` when the config has one, else ``hidden_size // num_attention_heads``."""
        c = self._text_config()
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def use_mla(self) -> bool:
        """Whether the model uses multi-head latent attention: its config has a
        ``kv_lora_rank`` (DeepSeek-V2/V3)."""
        return getattr(self._text_config(), "kv_lora_rank", None) is not None

    @property
    def mla_dims(self) -> Any:
        """The ``kvloom.attention.mla_backend.MLADims`` of an MLA model (``use_mla``)."""
        from kvloom.attention.mla_backend import MLADims

        c = self._text_config()
        if not self.use_mla:
            raise ValueError(f"model {self.architecture} does not use MLA (its config has no kv_lora_rank)")
        return MLADims(
            num_heads=c.num_attention_heads,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
        )

    @property
    def hidden_size(self) -> int:
        """``hidden_size`` of the (text) config."""
        return self._text_config().hidden_size

    @property
    def vocab_size(self) -> int:
        """``vocab_size`` of the (text) config."""
        return self._text_config().vocab_size


class CacheConfig(_Section):
    """The paged KV cache. Platforms and hooks may change the memory budget
    (``gpu_memory_utilization``, ``kv_cache_memory``, ``num_gpu_blocks_override``) and
    prefix caching; ``block_size`` and ``cache_dtype`` only to values the selected attention
    backend serves (checked: the engine refuses others with the backend's reasons)."""

    block_size: int = Field(ge=1)
    """Tokens per KV-cache block (``--block-size``, else the selected backend's preferred
    size)."""
    user_specified_block_size: bool
    """Whether the user gave ``--block-size``."""
    gpu_memory_utilization: float = Field(gt=0.0, le=1.0)
    """Fraction of the device memory the engine may use (the CUDA worker sizes the cache
    from it)."""
    kv_cache_memory: int | None = Field(default=None, gt=0)
    """KV-cache bytes (``--kv-cache-memory``); when set, the worker uses exactly this."""
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    """Force the number of KV-cache blocks (the worker's budget is not asked)."""
    cache_dtype: str
    """KV-cache dtype: ``auto`` (the model dtype), ``float16``, ``bfloat16``, ``float32``, or an
    fp8 cache (``fp8`` = ``fp8_e4m3``, ``fp8_e5m2``: per-tensor k/v scales from the checkpoint
    or 1.0, ``kvloom.attention.kv_quant``); a block's bytes follow it
    (``kvloom.attention.kv_quant.kv_cache_torch_dtype``)."""
    enable_prefix_caching: bool
    """Reuse the KV blocks of shared prompt prefixes."""
    prefix_caching_hash_algo: str
    """Block hash: ``sha256``, ``sha256_cbor`` or ``xxhash``."""
    num_blocks: int | None = None  # set once the worker has sized the cache
    """The number of KV-cache blocks, set by the engine once the worker has sized the cache
    (None before; read-only for plugins)."""


class SchedulerConfig(_Section):
    """Batching. Platforms and hooks may change every field, keeping
    ``max_num_batched_tokens >= max_num_seqs`` and ``max_model_len`` equal to
    ``model.max_model_len``."""

    max_num_seqs: int = Field(ge=1)
    """The most requests in one step."""
    max_num_batched_tokens: int = Field(ge=1)
    """The most tokens in one step (without chunked prefill at least ``max_model_len``)."""
    max_model_len: int = Field(ge=1)
    """The longest sequence; equal to ``model.max_model_len`` (change both or neither)."""
    long_prefill_token_threshold: int = Field(ge=0)
    """Cap on one request's prefill chunk per step (0: no cap); with chunked prefill only."""
    enable_chunked_prefill: bool
    """Split long prompts across steps."""
    policy: Literal["fcfs", "priority"]
    """Queue order: first come first served, or by request priority."""
    async_scheduling: bool = False
    """Schedule step n+1 while step n runs on the device. Resolved: ``EngineArgs``'
    ``async_scheduling=None`` (auto) is on where ``Platform.supports_async_scheduling``
    and without pipeline parallelism (``config_builder.resolve_async_scheduling``)."""


class ParallelConfig(_Section):
    """Parallelism: tensor and pipeline parallelism over worker processes, data-parallel replicas."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel degree: worker processes (ranks) that each hold a slice of every
    sharded layer (heads, MLP columns, vocabulary)."""
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Pipeline stages: each holds a contiguous run of the decoder layers (and their KV
    cache); the engine core keeps up to this many micro-batches in flight."""
    distributed_executor_backend: Literal["uni", "mp", "ray"] = "uni"
    """How the engine core runs its workers: "uni" (one worker in the engine core's
    process; tensor-parallel size 1), "mp" (one process per rank on this machine) or "ray"
    (one Ray actor per rank, placed on the nodes of a Ray cluster)."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Data-parallel replicas: engine core processes, each a whole model with its own KV
    cache, among which the front ends balance the requests."""

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine core: tensor-parallel size x pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class AttentionConfig(_Section):
    """The attention backend. Fixed once resolved: platforms and hooks must not change it
    (model layers and the KV cache are built for it)."""

    requested_backend: str | None  # the user's --attention-backend (None = by priority)
    """The user's ``--attention-backend`` NAME, or None (selected by the platform's priority)."""
    backend: type[AttentionBackend]  # what selection picked
    """The selected ``AttentionBackend`` class: pass it to every ``Attention`` layer. For an
    MLA model, the decode backend (it also owns the latent cache layout)."""
    requested_prefill_backend: str | None = None
    """MLA models: the user's ``--mla-prefill-backend`` NAME, or None (by the platform's
    MLA prefill priority)."""
    prefill_backend: type[AttentionBackend] | None = None
    """MLA models: the selected prefill backend (``MLAAttention``'s prefill path); None for
    other models."""

    # Plugin API 1.0 named the selected backend by its NAME here.
    selected_backend = deprecated_property(
        Deprecation("config.attention.selected_backend", "config.attention.backend.NAME", goes_in="1.2"),
        lambda self: self.backend.NAME,
    )


class LoadConfig(_Section):
    """Weight loading."""

    load_format: str
    """``auto``, ``safetensors``, ``pt``, ``gguf`` or ``dummy`` (random weights)."""
    source_kind: str = "hf"
    """Where the weights come from: ``hf`` (an HF directory) or ``gguf`` (a GGUF file)."""


class CompilationConfig(_Section):
    """torch.compile, CUDA graphs and the platform's custom ops. Platforms and hooks may
    change every field (turn compilation or graphs off, change the capture sizes,
    ``custom_ops``); ``cudagraph_mode`` is resolved again when the graphs are captured."""

    optimization_level: int = Field(ge=0, le=3)
    """``-O0`` .. ``-O3``: the defaults of the fields below."""
    enforce_eager: bool
    """No compilation and no CUDA graphs (unless set explicitly)."""
    compile_model: bool = False
    """``torch.compile`` the model's forward through kvloom's piecewise backend
    (``kvloom.compilation.backend``)."""
    use_inductor: bool = True
    """Compile the pieces with Inductor; False keeps them as FX modules (debugging)."""
    splitting_ops: list[str] = Field(default_factory=lambda: ["kvloom::unified_attention"])
    """Custom ops the graph is split at (each runs eagerly between two pieces): the
    attention op plus the ops the attention backend declares graph-unsafe."""
    cudagraph_mode: CUDAGraphMode
    """The resolved mode: NONE on a platform without ``supports_cuda_graphs``, downgraded
    by the backend's ``cudagraph_support`` and by an uncompiled model."""
    cudagraph_capture_sizes: list[int]
    """Token counts whose graphs are captured: full decode graphs for those up to
    ``max_num_seqs``, piecewise graphs for those up to ``max_num_batched_tokens``."""
    custom_ops: Literal["all", "none"] = "all"
    """``all``: the platform's ``custom_ops`` replace the layers' torch code; ``none``: the
    torch code runs everywhere."""


class LoRAConfig(_Section):
    """LoRA adapters. Platforms and hooks may lower the limits."""

    enable_lora: bool
    """Whether adapters can be served (the projections are wrapped at load)."""
    max_loras: int = Field(ge=1)
    """The most adapters in one step."""
    max_lora_rank: int = Field(ge=1)
    """The largest adapter rank."""
    max_cpu_loras: int = Field(ge=1)
    """Adapters kept loaded in host memory (at least ``max_loras``)."""
    lora_modules: dict[str, str] = Field(default_factory=dict)
    """``name -> path`` of the adapters the server loads at startup."""


class StructuredOutputsConfig(_Section):
    """Structured outputs (guided decoding). Platforms and hooks may change the backend."""

    backend: str = "xgrammar"
    """The grammar library: ``xgrammar`` (built in) or a plugin of the
    ``kvloom.structured_output_backends`` group."""
    reasoning_parser: str | None = None
    """The reasoning parser (``--reasoning-parser``): a grammar applies once the reasoning has
    ended. None: no reasoning parser."""
    enable_in_reasoning: bool = False
    """Whether the grammar also binds the reasoning (vLLM's option of the same name)."""


#: The speculative methods kvloom itself serves, with the names vLLM also accepts for them
#: (``deepseek_mtp`` is vLLM's older name of ``mtp``; ``eagle`` runs an EAGLE-3 head).
#: Plugins of ``kvloom.spec_decode_proposers`` add their own names.
BUILTIN_SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle3", "eagle", "mtp", "deepseek_mtp")

#: Keys of vLLM's ``--speculative-config`` that kvloom does not take yet (refused by name).
UNSUPPORTED_SPECULATIVE_KEYS: tuple[str, ...] = (
    "revision", "code_revision", "max_model_len", "disable_by_batch_size", "speculative_token_tree",
    "disable_padded_drafter_batch", "enforce_eager", "target_model_config", "draft_model_config",
    "disable_logprobs", "disable_log_stats", "suffix_decoding_max_tree_depth", "parallel_drafting",
)  # fmt: skip


class SpeculativeConfig(_Section):
    """Speculative decoding (``--speculative-config`` / ``LLM(speculative_config=...)``, vLLM's
    JSON object): a proposer drafts up to ``num_speculative_tokens`` tokens per request and
    step, the target model verifies them all in one forward and a rejection sampler keeps
    its output distribution exactly (``docs/speculative_decoding.md``). Fixed once resolved:
    platforms and hooks must not change it (the KV cache and the runner are built for it).

    The user's keys are validated by ``from_user``; ``create_engine_config`` then resolves
    the proposer (``proposer``) and, for a draft model, its ``draft`` model section."""

    method: str
    """``ngram`` (prompt lookup), ``draft_model``, ``eagle3`` (``eagle``: an EAGLE-3 head
    too), ``mtp`` (``deepseek_mtp``: DeepSeek-V3's multi-token-prediction layer) or a
    ``kvloom.spec_decode_proposers`` plugin's method. Once resolved: the proposer's NAME."""
    num_speculative_tokens: int = Field(ge=1, le=32)
    """Draft tokens per request and step (k): each step verifies up to k + 1 positions."""
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    """``ngram``: the shortest suffix n-gram looked up in the context (default: ``prompt_lookup_max``, else 5)."""
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    """``ngram``: the longest suffix n-gram looked up (default: ``prompt_lookup_min``, else 5)."""
    model: str | None = None
    """``draft_model``: the draft checkpoint (HF directory or ``.gguf``), sharing the target's
    vocabulary; ``eagle3``: the EAGLE-3 head's directory; ``mtp``: none (the target's own layer)."""
    draft_tensor_parallel_size: int | None = Field(default=None, ge=1)
    """Tensor-parallel ranks of the draft model: the target's (the default) is the only value."""
    quantization: str | None = None
    """The draft model's quantization (as ``--quantization``; default: its checkpoint's)."""
    proposer: Any = None  # type[SpecDecodeProposer], set by create_engine_config
    """Resolved: the ``kvloom.interfaces.SpecDecodeProposer`` class that drafts."""
    draft: ModelConfig | None = None
    """Resolved: the draft model's section (``draft_model``, ``eagle3``), else None."""

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request keeps past its computed tokens for the proposer's own writes
        (a draft model writes the KV of its drafts): k for proposers with a KV cache, else 0."""
        proposer = self.proposer
        return self.num_speculative_tokens if proposer is not None and proposer.uses_kv_cache else 0

    @classmethod
    def from_user(cls, value: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """The user's JSON object checked: known keys, types and ranges, each method's
        required keys and defaults. A ``ValueError`` names the field and what it allows."""
        if isinstance(value, SpeculativeConfig):
            value = value.model_dump(exclude={"proposer", "draft"}, exclude_none=True)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        user_keys = [name for name in cls.model_fields if name not in ("proposer", "draft")]
        for key in value:
            if key in UNSUPPORTED_SPECULATIVE_KEYS:
                raise ValueError(f"speculative_config.{key} is not supported by kvloom yet")
            if key not in user_keys:
                raise ValueError(f"speculative_config: unknown key {key!r} (allowed: {', '.join(user_keys)})")
        values = dict(value)
        method = values.get("method")
        if method is None:
            if values.get("model") is None:
                raise ValueError("speculative_config.method is required (allowed: "
                                 f"{', '.join(BUILTIN_SPECULATIVE_METHODS)}, or a proposer plugin's method)")  # fmt: skip
            values["method"] = method = "draft_model"
        if not isinstance(method, str) or not method.strip():
            raise ValueError(f"speculative_config.method must be a method name (allowed: "
                             f"{', '.join(BUILTIN_SPECULATIVE_METHODS)}, or a proposer plugin's method)")  # fmt: skip
        if method in ("ngram", "[ngram]"):
            values["method"] = "ngram"
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            values["prompt_lookup_min"] = low if low is not None else (high if high is not None else 5)
            values["prompt_lookup_max"] = high if high is not None else values["prompt_lookup_min"]
        if method not in ("mtp", "deepseek_mtp") and values.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (an integer, 1..32)")
        values.setdefault("num_speculative_tokens", 1)  # mtp: the checkpoint's layers decide (resolved later)
        try:
            config = cls(**values)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(p) for p in error["loc"])
            raise ValueError(f"speculative_config.{field}: {error['msg']} (got {error.get('input')!r:.60})") from None
        if config.prompt_lookup_min is not None and config.prompt_lookup_max is not None:
            if config.prompt_lookup_min > config.prompt_lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) must be <= "
                                 f"prompt_lookup_max ({config.prompt_lookup_max})")  # fmt: skip
        if config.method in ("draft_model", "eagle3", "eagle") and not config.model:
            raise ValueError(f"speculative_config.model is required for method {config.method!r} (the draft's "
                             "checkpoint directory)")  # fmt: skip
        return config


class ObservabilityConfig(_Section):
    """Engine statistics. Platforms and hooks may change both fields."""

    disable_log_stats: bool
    """No stats: no summary line, no engine metrics, no stat logger plugins."""
    log_stats_interval: float = Field(gt=0.0)
    """Seconds (> 0) between the stat loggers' ``log()`` summaries."""


class DeviceConfig(_Section):
    """The device. Fixed once resolved: platforms and hooks must not change it."""

    platform: type[Platform]  # the active platform
    """The active ``Platform`` class."""
    device_type: str
    """Its torch device type (``platform.device_type``)."""


class EngineConfig(_Section):
    """The resolved configuration every component receives: one pydantic model per
    section, each validated on assignment (a wrong type or an out-of-range value raises
    ``pydantic.ValidationError`` naming the field). A platform's
    ``check_and_update_config`` and the general plugins' ``kvloom_update_engine_config``
    adjust it in place; what they may change is said section by section (``docs/plugins.md``,
    "The engine config"): never the model, the attention backend or the platform."""

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
    """Parallelism (``tensor_parallel_size``, ``pipeline_parallel_size``, ``distributed_executor_backend``,
    ``data_parallel_size``)."""
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
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    """``backend``: the structured-output backend's name."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (``--speculative-config``), or None: off."""
    kv_transfer: KVTransferConfig | None = None
    """The KV connector (``--kv-transfer-config``, or ``--kv-offloading-size``): which one,
    its role and extra config; None: no connector. Platforms and hooks must not change it."""

    # Names of plugin API 1.0 that moved into the sections (a model plugin reading
    # config.attention_backend must keep working, with a warning, not die at engine start).
    attention_backend = deprecated_property(
        Deprecation("config.attention_backend", "config.attention.backend", goes_in="1.2"),
        lambda self: self.attention.backend,
    )
    platform = deprecated_property(
        Deprecation("config.platform", "config.device.platform", goes_in="1.2"),
        lambda self: self.device.platform,
    )
