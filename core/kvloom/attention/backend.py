"""The attention backend contract.

An attention backend is a plugin (entry-point group ``kvloom.attention_backends``,
entry-point name == the backend's ``NAME``) that tells the engine three things:

1. What it supports, declared as class attributes (dtypes, KV-cache dtypes, block sizes,
   head sizes, compute capability, device types, MLA or not, attention types, CUDA-graph
   support, and the attention features some models need: sliding windows, attention
   sinks, logit soft-capping). ``validate_configuration`` turns those declarations into
   human-readable reasons; selection never guesses.
2. How its KV cache is laid out (``get_kv_cache_shape``).
3. Which classes do the work: an ``AttentionMetadataBuilder`` that turns the model
   runner's ``CommonAttentionMetadata`` into whatever the kernels need (once per step,
   shared by all layers), and an ``AttentionImpl`` whose ``forward`` writes the new keys
   and values into the paged cache through the slot mapping and computes attention.

Data layout every backend receives (N = tokens in the step, B = requests in the step):

- ``query``  ``[N, num_heads, head_size]``, ``key``/``value`` ``[N, num_kv_heads, head_size]``
  (N may be padded beyond ``num_actual_tokens`` for CUDA graphs; the padding must not be
  written to the cache: its ``slot_mapping`` entries are ``-1``).
- Requests are laid out contiguously: request ``i`` owns tokens
  ``query_start_loc[i]:query_start_loc[i+1]``; its tokens are the *last* ``query_len``
  tokens of a sequence of ``seq_lens[i]`` tokens, so token ``j`` of the request sits at
  position ``seq_lens[i] - query_len + j`` and attends causally to positions ``<=`` it.
  The first ``seq_lens[i] - query_len`` positions (the context: prefix-cache hits, earlier
  prefill chunks, earlier decode steps) are already in the cache.
- ``block_table[i, k]`` is the physical block holding positions
  ``k*block_size : (k+1)*block_size`` of request ``i``; ``slot_mapping[t]`` is
  ``block * block_size + offset`` of token ``t``.

Attention features (each declared by a backend, refused with a reason when it lacks it):

- Sliding window ``W`` (``AttentionLayerSpec.sliding_window``, the impl's
  ``sliding_window``): the query at position ``p`` sees positions ``p - W + 1 .. p`` (``W``
  keys, its own included; HF's convention). Blocks wholly before the window of a
  request's first query of the step may hold anything: the KV-cache manager gave them back
  (the entry is then the null block, or a stale id now used by another request), so a
  backend must not read them, or must read them as masked with values that cannot be NaN.
- Attention sinks (gpt-oss; the impl's ``sinks``, float32 ``[num_heads]``): one learned
  logit per query head joins every softmax's denominator and contributes no value:
  ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``.
- Logit soft-capping ``c`` (Gemma 2; ``logits_soft_cap``): each scaled score ``s`` becomes
  ``c * tanh(s / c)`` before the mask and the softmax.
"""

from __future__ import annotations

import enum
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.platforms.interface import DeviceCapability


class AttentionType(str, enum.Enum):
    """Which attention pattern a layer uses (vLLM's names)."""

    DECODER = "decoder"
    """Causal self-attention over the KV cache (every decoder-only LLM)."""
    ENCODER = "encoder"
    """Bidirectional self-attention, the encoder of an encoder-decoder model."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention without a KV cache (encoder-only embedding models)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention from the decoder to the encoder's output."""


class AttentionCGSupport(enum.IntEnum):
    """How much of a step a backend can run inside a captured CUDA graph.

    Ordered: ALWAYS > UNIFORM_BATCH > UNIFORM_SINGLE_TOKEN_DECODE > NEVER.
    """

    NEVER = 0
    """No batch: the engine runs every step eagerly."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Only batches where every request has ``query_len == 1`` (pure decode)."""
    UNIFORM_BATCH = 2
    """Batches where every request has the same ``query_len``."""
    ALWAYS = 3
    """Any batch, including mixed prefill and decode."""


def effective_decode_graphs(mode: CUDAGraphMode, support: AttentionCGSupport) -> bool:
    """Whether uniform decode batches run as full graphs for this mode and backend."""
    if mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        return False
    return support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def window_start(query_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """The first position each query position ``p`` sees: ``p - W + 1``, at least 0, with a
    sliding window ``W``; 0 without one (the module docstring's rule)."""
    if sliding_window is None:
        return torch.zeros_like(query_positions)
    return (query_positions - sliding_window + 1).clamp(min=0)


@dataclass(frozen=True)
class MultipleOf:
    """A block-size declaration meaning "any positive multiple of ``base``"."""

    base: int
    """The block size must be a positive multiple of this."""

    def accepts(self, block_size: int) -> bool:
        """Whether ``block_size`` is a positive multiple of ``base``."""
        return block_size > 0 and block_size % self.base == 0

    def __str__(self) -> str:
        return f"multiples of {self.base}"


BlockSizeSpec = int | MultipleOf
"""One entry of ``AttentionBackend.supported_block_sizes``: an exact block size, or ``MultipleOf(n)``."""

#: The block size the engine uses when neither the user nor the backend asks for another
#: (``AttentionBackend.preferred_block_size``).
DEFAULT_BLOCK_SIZE = 16

_BF16_MIN_CAPABILITY = DeviceCapability(8, 0)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """Everything selection needs to know about the model and the run.

    ``block_size`` is ``None`` when the user did not choose one: the engine then asks the
    selected backend for its preferred size (block-size negotiation).
    """

    head_size: int
    """The model's attention head size."""
    dtype: torch.dtype
    """The model dtype."""
    kv_cache_dtype: str = "auto"
    """The KV-cache dtype: ``"auto"`` (the model dtype) or a dtype name."""
    block_size: int | None = None
    """The user's block size; ``None`` when the user set none (the backend then picks)."""
    use_mla: bool = False
    """Whether the model uses multi-head latent attention (MLA)."""
    mla_phase: str | None = None
    """MLA models: which phase is being selected, ``"decode"`` (``head_size`` is the latent
    row, ``kv_lora_rank + qk_rope_head_dim``) or ``"prefill"`` (``head_size`` is
    ``qk_nope_head_dim + qk_rope_head_dim``, values ``v_head_dim`` wide); ``None`` otherwise
    (see ``kvloom.attention.mla_backend``)."""
    v_head_dim: int | None = None
    """MLA prefill: the value head size (``None`` when it equals ``head_size``)."""
    attn_type: AttentionType = AttentionType.DECODER
    """The attention pattern of the layers."""
    device_type: str = "cpu"
    """The active platform's torch device type."""
    device_capability: DeviceCapability | None = None
    """The device's compute capability (CUDA-like devices), else ``None``."""
    num_heads: int | None = None
    """Query heads of the model (``None`` when unknown, e.g. ``kvloom backends`` without ``--model``)."""
    num_kv_heads: int | None = None
    """Key/value heads of the model (``None`` when unknown)."""
    sliding_window: int | None = None
    """The smallest sliding window of the model's layers (``None``: no sliding-window layer)."""
    has_sinks: bool = False
    """Whether the model's attention has sinks (gpt-oss)."""
    logits_soft_cap: float | None = None
    """The model's attention logit soft-cap (Gemma 2), or ``None``."""


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description built by the model runner, shared by all backends.

    Device tensors live on the model's device; the ``*_cpu`` copies are there for
    builders that plan on the host (e.g. FlashInfer) so they need not synchronise.
    """

    query_start_loc: torch.Tensor
    """int32 ``[B + 1]``: request ``i`` owns token rows ``query_start_loc[i]:query_start_loc[i+1]``."""
    seq_lens: torch.Tensor
    """int32 ``[B]``: each request's context plus this step's tokens."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks_per_req]``: ``block_table[i, k]`` is the physical block holding
    positions ``k*block_size : (k+1)*block_size`` of request ``i``; entries past the request's
    last block hold arbitrary valid block ids."""
    slot_mapping: torch.Tensor
    """int64 ``[N]``: ``block * block_size + offset`` of each token's K/V; ``-1`` = do not write
    (padding)."""
    num_reqs: int
    """B, the requests in the step (CUDA-graph filler requests included)."""
    num_actual_tokens: int
    """Tokens before CUDA-graph padding; attention is computed for these rows only."""
    max_query_len: int
    """The largest query length of the step."""
    max_seq_len: int
    """The largest ``seq_lens`` entry of the step."""
    query_start_loc_cpu: torch.Tensor
    """int32 ``[B + 1]``: the host copy of ``query_start_loc``."""
    seq_lens_cpu: torch.Tensor
    """int32 ``[B]``: the host copy of ``seq_lens``."""
    causal: bool = True
    """Whether attention is causal (token ``j`` sees positions up to its own)."""

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """int32 ``[B]``: each request's query length, on the host."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def is_uniform_single_token_decode(self) -> bool:
        """Whether every request of the step has query length 1."""
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionLayerSpec:
    """The static shape of the attention layers a builder serves."""

    num_heads: int
    """Query heads of every attention layer."""
    num_kv_heads: int
    """Key/value heads of every attention layer."""
    head_size: int
    """Head size of every attention layer."""
    dtype: torch.dtype
    """The model dtype (of query, key, value and output)."""
    kv_cache_dtype: torch.dtype
    """The dtype of the KV-cache tensors."""
    block_size: int
    """Tokens per KV-cache block."""
    max_num_seqs: int
    """The most requests in one step (size persistent buffers by it)."""
    max_model_len: int
    """The longest sequence, in tokens."""
    scale: float
    """The softmax scale of the layers."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else a builder may need (empty today)."""
    sliding_window: int | None = None
    """The layers' sliding window (a KV-cache group's layers share it), or ``None``."""
    logits_soft_cap: float | None = None
    """The layers' attention logit soft-cap, or ``None``."""


M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns ``CommonAttentionMetadata`` into backend metadata, once per step.

    What the metadata can do inside a captured graph is the backend's
    ``AttentionBackend.cudagraph_support``. Builders that keep persistent buffers for graphs
    should size them from ``spec.max_num_seqs`` and ``max_num_blocks`` at construction.
    """

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        self.spec = spec
        self.device = device
        self.max_num_blocks = max_num_blocks

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """Metadata for one step (called outside of CUDA-graph capture and replay)."""

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> M:
        """Metadata for a CUDA-graph batch: called once when the graph for batch size
        ``common.num_reqs`` is captured and again before every replay of it.

        ``common``'s tensors are views of the model runner's persistent buffers. Any device
        tensor the builder derives must be written into builder-owned buffers that are the
        same for every call with the same batch size (the captured kernels keep pointing at
        them), and launch parameters must depend only on the batch size and fixed limits,
        never on this step's lengths. Defaults to ``build`` (fine for builders that derive
        no device tensors and use no host lengths).
        """
        return self.build(common)


class AttentionImpl(ABC, Generic[M]):
    """Computes attention for one layer. One instance per layer.

    The constructor refuses what the impl does not implement (``NotImplementedError``
    naming the field): by default anything but causal decoder attention with an "auto"
    KV cache. Impls that do more widen the class attributes below.
    """

    impl_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    """Attention types this impl computes (others are refused by the constructor)."""
    impl_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """KV-cache dtypes this impl reads and writes (an fp8 cache: ``"fp8"``, ``"fp8_e4m3"``,
    ``"fp8_e5m2"``, with ``k_scale`` / ``v_scale``)."""
    impl_supports_sliding_window: ClassVar[bool] = False
    """Whether this impl masks to a ``sliding_window`` (else a window is refused)."""
    impl_supports_logits_soft_cap: ClassVar[bool] = False
    """Whether this impl applies ``logits_soft_cap`` (else a cap is refused)."""
    impl_supports_sinks: ClassVar[bool] = False
    """Whether this impl adds attention ``sinks`` to the softmax (else sinks are refused)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        #: Per-tensor scales of an fp8 KV cache (``kvloom.attention.kv_quant``): the cache
        #: holds ``fp8(k / k_scale)``. Set by the ``Attention`` layer from the checkpoint
        #: once the weights are loaded (1.0 without); read by impls that declare fp8.
        self.k_scale = 1.0
        self.v_scale = 1.0
        #: float32 ``[num_heads]`` learned sink logits (the layer's parameter, filled when
        #: the weights load), or None.
        self.sinks = sinks
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.queries_per_kv = num_heads // num_kv_heads
        name = type(self).__name__
        if attn_type not in self.impl_attn_types:
            allowed = ", ".join(t.value for t in self.impl_attn_types)
            raise NotImplementedError(f"{name}: attn_type {attn_type.value} not supported (supports {allowed})")
        if kv_cache_dtype not in self.impl_kv_cache_dtypes:
            allowed = ", ".join(self.impl_kv_cache_dtypes)
            raise NotImplementedError(f"{name}: kv_cache_dtype {kv_cache_dtype} not supported (supports {allowed})")
        if sliding_window is not None and not self.impl_supports_sliding_window:
            raise NotImplementedError(f"{name}: sliding_window={sliding_window} not supported (supports None)")
        if logits_soft_cap is not None and not self.impl_supports_logits_soft_cap:
            raise NotImplementedError(f"{name}: logits_soft_cap={logits_soft_cap} not supported (supports None)")
        if sinks is not None:
            if not self.impl_supports_sinks:
                raise NotImplementedError(f"{name}: attention sinks not supported (supports None)")
            if tuple(sinks.shape) != (num_heads,):
                raise ValueError(f"{name}: sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into ``kv_cache`` at ``slot_mapping`` (skipping -1),
        then write attention for the first ``num_actual_tokens`` queries into ``output``
        (``[N, num_heads, head_size]``) and return it.

        ``query`` is ``[N, num_heads, head_size]``, ``key``/``value`` are ``[N, num_kv_heads,
        head_size]``, all strided views of the model's fused QKV output (last dimension
        contiguous, token rows further apart). Rows past ``num_actual_tokens`` are padding
        (slot ``-1``). ``kv_cache`` is this layer's tensor of ``get_kv_cache_shape``;
        ``attn_metadata`` is what the builder built for this step."""


class AttentionBackend(ABC):
    """Declares what a backend supports and which classes implement it.

    Subclasses set the class attributes below and implement the three static methods.
    ``validate_configuration`` has a complete default built from the declarations;
    override ``extra_validation`` for checks the declarations cannot express.
    """

    NAME: ClassVar[str]
    """The backend's unique name (also its entry-point name and what ``--attention-backend`` takes)."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    """Model dtypes the kernels accept."""
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """KV-cache dtypes ("auto" = same as the model dtype; fp8 caches: ``"fp8"``,
    ``"fp8_e4m3"``, ``"fp8_e5m2"``, which a backend declares only when its kernels write
    and read them with the impl's ``k_scale`` / ``v_scale``: there is no fallback)."""
    supported_block_sizes: ClassVar[tuple[BlockSizeSpec, ...]] = (MultipleOf(16),)
    """Block sizes: exact ints and/or ``MultipleOf(n)``. When the user sets no block size
    the engine uses 16 if it is accepted, else the first entry (for a ``MultipleOf(n)``
    first entry, the smallest multiple of n that is >= 16): see ``preferred_block_size``
    and docs/attention_backends.md."""
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    """Head sizes; ``None`` means any size up to ``max_head_size``."""
    max_head_size: ClassVar[int] = 256
    """The largest head size when ``supported_head_sizes`` is ``None``."""
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    """torch device types this backend runs on ("cpu", "cuda", ...)."""
    min_compute_capability: ClassVar[DeviceCapability | None] = None
    """Lowest compute capability served, inclusive (CUDA only); ``None`` = no bound."""
    max_compute_capability: ClassVar[DeviceCapability | None] = None
    """Highest compute capability served, inclusive (CUDA only); ``None`` = no bound."""
    is_mla: ClassVar[bool] = False
    """An MLA backend serves only MLA models, and only MLA backends serve them. MLA
    backends subclass ``kvloom.attention.mla_backend.MLAAttentionBackend`` (latent cache layout,
    ``mla_phases``) and return an ``MLAAttentionImpl`` from ``get_impl_cls``."""
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    """Attention types the backend serves."""
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    """Which batches the builder's metadata can serve inside a captured full CUDA graph
    (``NEVER``: no full graphs; piecewise graphs run attention outside the graphs and
    need no support)."""
    splitting_ops: ClassVar[tuple[str, ...]] = ()
    """Custom ops (``namespace::name``) the backend's model code calls that must not be
    compiled or captured: the compiled graph is split at them, as at the attention op."""
    required_modules: ClassVar[dict[str, str]] = {}
    """Python modules the kernels import, with the pip distribution that provides each,
    e.g. ``{"flashinfer": "flashinfer-python"}``. A missing one is a reason, not a crash."""
    supports_sliding_window: ClassVar[bool] = False
    """Whether the backend computes sliding-window attention (Mistral, Qwen2, Gemma 2/3,
    gpt-oss); the impl declares it too (``AttentionImpl.impl_supports_sliding_window``)."""
    supports_sinks: ClassVar[bool] = False
    """Whether the backend adds attention sinks to the softmax (gpt-oss)."""
    supports_logits_soft_cap: ClassVar[bool] = False
    """Whether the backend soft-caps the attention logits (Gemma 2)."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The ``AttentionImpl`` subclass; the model's ``Attention`` layers build one per layer."""

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The ``AttentionMetadataBuilder`` subclass; the model runner builds one per engine."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's cache as ``(key_cache, value_cache)``, each indexed
        ``[block, offset_in_block, kv_head, dim]`` (a permuted view is fine).

        The default matches the layout ``(2, num_blocks, block_size, num_kv_heads,
        head_size)``; backends with another layout override it. The conformance suite and
        debugging tools use it to read what ``forward`` wrote.
        """
        return kv_cache[0], kv_cache[1]

    # ------------------------------------------------------------------ validation
    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """Whether ``supported_block_sizes`` accepts ``block_size``."""
        return any(
            spec.accepts(block_size) if isinstance(spec, MultipleOf) else spec == block_size
            for spec in cls.supported_block_sizes
        )

    @classmethod
    def describe_block_sizes(cls) -> str:
        """The accepted block sizes in words, for validation reasons."""
        return ", ".join(str(s) for s in cls.supported_block_sizes)

    @classmethod
    def preferred_block_size(cls, default: int = DEFAULT_BLOCK_SIZE) -> int:
        """The block size the engine uses with this backend when the user sets none:
        ``default`` if accepted, else the first declared entry (rounded up to a multiple
        for ``MultipleOf``). E.g. ``(MultipleOf(256),)`` -> 256, ``(32, 64)`` -> 32."""
        if cls.supports_block_size(default):
            return default
        first = cls.supported_block_sizes[0]
        if isinstance(first, MultipleOf):
            return -(-default // first.base) * first.base
        return first

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether the backend serves ``head_size`` (``supported_head_sizes``, else up to
        ``max_head_size``). Override it, and ``describe_head_sizes``, for other rules."""
        if cls.supported_head_sizes is not None:
            return head_size in cls.supported_head_sizes
        return 0 < head_size <= cls.max_head_size

    @classmethod
    def describe_head_sizes(cls) -> str:
        """The accepted head sizes in words, for validation reasons. Backends that
        override ``supports_head_size`` with a rule the declarations cannot express
        (e.g. "multiples of 8 up to 256") override this too."""
        if cls.supported_head_sizes is not None:
            return ", ".join(map(str, cls.supported_head_sizes))
        return f"1..{cls.max_head_size}"

    @classmethod
    def missing_modules(cls) -> list[str]:
        """Reasons for each required module that cannot be imported."""
        reasons = []
        for module, dist in cls.required_modules.items():
            if importlib.util.find_spec(module) is None:
                reasons.append(f"{module} is not installed (pip install {dist})")
        return reasons

    @classmethod
    def validate_configuration(cls, config: AttentionSelectorConfig) -> list[str]:
        """Every reason this backend cannot serve ``config``; empty means valid."""
        reasons: list[str] = []
        if config.device_type not in cls.supported_device_types:
            reasons.append(
                f"device type {config.device_type} not supported "
                f"(supports {', '.join(cls.supported_device_types)})"
            )
        if config.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype_name(config.dtype)} not supported "
                f"(supports {', '.join(dtype_name(d) for d in cls.supported_dtypes)})"
            )
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv cache dtype {config.kv_cache_dtype} not supported "
                f"(supports {', '.join(cls.supported_kv_cache_dtypes)})"
            )
        if config.block_size is not None and not cls.supports_block_size(config.block_size):
            reasons.append(
                f"block size {config.block_size} not supported (supports {cls.describe_block_sizes()})"
            )
        if not cls.supports_head_size(config.head_size):
            reasons.append(f"head size {config.head_size} not supported (supports {cls.describe_head_sizes()})")
        if config.use_mla != cls.is_mla:
            reasons.append("MLA not supported" if config.use_mla else "only MLA models supported")
        if config.attn_type not in cls.supported_attn_types:
            reasons.append(
                f"attention type {config.attn_type.value} not supported "
                f"(supports {', '.join(t.value for t in cls.supported_attn_types)})"
            )
        if config.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append(f"sliding-window attention (window {config.sliding_window}) not supported")
        if config.has_sinks and not cls.supports_sinks:
            reasons.append("attention sinks not supported")
        if config.logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            reasons.append(f"attention logit soft-capping ({config.logits_soft_cap}) not supported")
        cap = config.device_capability
        if cap is not None and config.device_type == "cuda":
            lo, hi = cls.min_compute_capability, cls.max_compute_capability
            if (lo is not None and cap < lo) or (hi is not None and cap > hi):
                reasons.append(
                    f"compute capability {cap} not supported (supports "
                    f"{lo or 'any'}..{hi or 'any'})"
                )
            elif config.dtype == torch.bfloat16 and cap < _BF16_MIN_CAPABILITY:
                # A hardware fact, whatever the backend: no bf16 before Ampere.
                reasons.append(
                    f"dtype bfloat16 needs compute capability >= {_BF16_MIN_CAPABILITY} "
                    f"(device has {cap}); use float16"
                )
        reasons.extend(cls.missing_modules())
        reasons.extend(cls.extra_validation(config))
        return reasons

    @classmethod
    def extra_validation(cls, config: AttentionSelectorConfig) -> list[str]:
        """Backend-specific reasons beyond the declared support. Default: none."""
        return []

    @classmethod
    def support_summary(cls) -> dict[str, Any]:
        """The declared support as plain data (for tests and documentation tables; the
        engine and ``kvloom backends`` read the declarations themselves)."""
        return {
            "dtypes": [dtype_name(d) for d in cls.supported_dtypes],
            "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
            "block_sizes": [str(s) for s in cls.supported_block_sizes],
            "head_sizes": list(cls.supported_head_sizes)
            if cls.supported_head_sizes is not None
            else f"<= {cls.max_head_size}",
            "device_types": list(cls.supported_device_types),
            "compute_capability": [
                str(cls.min_compute_capability) if cls.min_compute_capability else None,
                str(cls.max_compute_capability) if cls.max_compute_capability else None,
            ],
            "mla": cls.is_mla,
            "attention_types": [t.value for t in cls.supported_attn_types],
            "cudagraph_support": cls.cudagraph_support.name,
            "sliding_window": cls.supports_sliding_window,
            "sinks": cls.supports_sinks,
            "logits_soft_cap": cls.supports_logits_soft_cap,
        }
