"""KV-cache specs per layer and the KV-cache groups they form (vLLM's hybrid KV cache
manager; the design is the seeds' "Hybrid KV Cache Manager").

Every attention layer has a ``KVCacheSpec``: which cached positions its attention still
reads, hence which blocks a request must keep for it.

- ``FullAttentionSpec``: every position, so every block of the request.
- ``SlidingWindowSpec(sliding_window=W)``: a query at position ``p`` reads positions
  ``p - W + 1 .. p`` (HF's convention: ``W`` keys, the query's own included). Blocks wholly
  before the window of the next token to compute are given back.
- ``ChunkedLocalAttentionSpec(attention_chunk_size=C)``: a query reads its own chunk of
  ``C`` positions up to itself (Llama 4's local layers).

Layers whose specs are equal form KV-cache groups: a group's layers need the same blocks
for a request, so they share one block table (``KVCacheGroupSpec``). All groups take their
blocks from one pool of one page size. A model with one kind of layer has one group
holding every layer (the plain paged cache). A hybrid model is cut into groups of equal
layer count, ``min`` over the kinds of the number of layers of that kind (the seeds'
cases 2 and 3): 10 full + 20 sliding-window layers give 3 groups of 10 (one full, two
sliding); Gemma-3-27B's 10 full + 52 sliding give 1 + 6 groups of 10 and a last group of
2 sliding layers (8 padding slots). The model runner allocates one buffer per layer slot
of a group, shared by one layer of every group (``kvloom.worker.kv_cache_memory``).

The specs come from the model's HF config (``layer_kv_cache_specs``: ``layer_types``,
``sliding_window``, ``use_sliding_window``, ``attention_chunk_size``), so the scheduler
(engine core) and every worker rank (each holding some of the layers under pipeline
parallelism) derive the same groups without exchanging anything; the runner checks that
its ``Attention`` layers agree (``kvloom.worker.kv_cache_groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloom.utils import cdiv

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

#: HF ``layer_types`` entries and what they mean here.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer's attention needs of the KV cache (subclasses: the attention types)."""

    block_size: int
    """Tokens per KV-cache block."""

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading positions that no query from ``num_computed_tokens`` on reads: their
        blocks can be given back. Full attention skips none."""
        return 0

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once in this layer,
        computing at most ``max_num_batched_tokens`` tokens per step."""
        return cdiv(num_tokens, self.block_size)

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Full causal attention: every block of the request is kept."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Sliding-window attention over the last ``sliding_window`` positions (the query's own included)."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        # The window before the step's first token plus the step's tokens, straddling one
        # more block boundary than a block-aligned run would.
        window_tokens = min(num_tokens, self.sliding_window - 1 + max_num_batched_tokens)
        return min(cdiv(num_tokens, self.block_size), cdiv(window_tokens, self.block_size) + 1)

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}"


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Attention within chunks of ``attention_chunk_size`` positions (a query reads its own
    chunk up to itself)."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        if self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1, got {self.attention_chunk_size}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        chunk_tokens = min(num_tokens, self.attention_chunk_size + max_num_batched_tokens)
        return min(cdiv(num_tokens, self.block_size), cdiv(chunk_tokens, self.block_size) + 1)

    def describe(self) -> str:
        return f"chunked local attention {self.attention_chunk_size}"


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: their indices in the model (HF's decoder-layer
    index) and their common spec."""

    layer_indices: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The model's KV-cache groups (one, or a hybrid model's several of equal size)."""

    groups: tuple[KVCacheGroupSpec, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Layer slots per group (the largest group; shorter groups are padded): the
        model runner's buffers."""
        return max(len(g.layer_indices) for g in self.groups)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(g.kv_cache_spec for g in self.groups)

    @property
    def needs_null_block(self) -> bool:
        """Whether some group gives back blocks (their table entries then hold the pool's
        null block, block 0, which no request gets)."""
        return any(not isinstance(spec, FullAttentionSpec) for spec in self.specs)

    def group_of_layer(self) -> dict[int, tuple[int, int]]:
        """Layer index -> (group, slot in the group)."""
        return {layer: (g, slot) for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layer_indices)}

    def blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks of the pool one request of ``num_tokens`` tokens holds at most."""
        return sum(spec.max_num_blocks(num_tokens, max_num_batched_tokens) for spec in self.specs)

    def max_tokens_in(self, num_blocks: int, max_num_batched_tokens: int, limit: int) -> int:
        """The longest request (up to ``limit`` tokens) that ``num_blocks`` blocks hold."""
        lo, hi = 0, limit
        while lo < hi:  # the largest n with blocks_per_request(n) <= num_blocks
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid, max_num_batched_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        parts = [f"{len(g.layer_indices)} x {g.kv_cache_spec.describe()}" for g in self.groups]
        return f"{self.num_groups} KV-cache group(s): " + ", ".join(parts)


# ---------------------------------------------------------------------- from the HF config
def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def layer_type_of(hf_config: Any, layer_idx: int) -> str:
    """The attention type of decoder layer ``layer_idx`` (an entry of ``LAYER_TYPES``), by
    HF's conventions: ``layer_types`` when the config lists them (Gemma 2/3, gpt-oss,
    Qwen2, Llama 4), else every layer sliding when ``sliding_window`` is set (Mistral), and
    never sliding with ``use_sliding_window: false`` or without a window."""
    config = _text_config(hf_config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if not 0 <= layer_idx < len(layer_types):
            raise ValueError(f"layer_types has {len(layer_types)} entries; layer {layer_idx} has none")
        kind = layer_types[layer_idx]
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}] = {kind!r} is not supported (supported: {', '.join(LAYER_TYPES)})")
        if kind == SLIDING_ATTENTION and window is None:
            return FULL_ATTENTION  # HF attends to everything when no window is set
        if kind == CHUNKED_ATTENTION and getattr(config, "attention_chunk_size", None) is None:
            return FULL_ATTENTION
        return kind
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return FULL_ATTENTION
    return SLIDING_ATTENTION


def sliding_window_of(hf_config: Any, layer_idx: int, max_model_len: int | None = None) -> int | None:
    """The sliding window of decoder layer ``layer_idx``, or None (not a sliding-window
    layer, or a window of at least ``max_model_len`` tokens, which no query can exceed:
    the layer is then full attention, e.g. Mistral-7B-v0.1's 4096 at ``--max-model-len 4096``)."""
    if layer_type_of(hf_config, layer_idx) != SLIDING_ATTENTION:
        return None
    window = int(_text_config(hf_config).sliding_window)
    return None if max_model_len is not None and window >= max_model_len else window


def attention_chunk_size_of(hf_config: Any, layer_idx: int) -> int | None:
    """The attention chunk of decoder layer ``layer_idx``, or None (not a chunked layer)."""
    if layer_type_of(hf_config, layer_idx) != CHUNKED_ATTENTION:
        return None
    return int(_text_config(hf_config).attention_chunk_size)


def layer_kv_cache_spec(hf_config: Any, layer_idx: int, block_size: int, max_model_len: int) -> KVCacheSpec:
    """The ``KVCacheSpec`` of decoder layer ``layer_idx`` (a window or chunk of at least
    ``max_model_len`` tokens never takes effect: full attention)."""
    window = sliding_window_of(hf_config, layer_idx, max_model_len)
    if window is not None:
        return SlidingWindowSpec(block_size, sliding_window=window)
    chunk = attention_chunk_size_of(hf_config, layer_idx)
    if chunk is not None and chunk < max_model_len:
        return ChunkedLocalAttentionSpec(block_size, attention_chunk_size=chunk)
    return FullAttentionSpec(block_size)


def layer_kv_cache_specs(hf_config: Any, block_size: int, max_model_len: int) -> list[KVCacheSpec]:
    """The spec of every decoder layer of the model (``num_hidden_layers`` of its text config)."""
    num_layers = _text_config(hf_config).num_hidden_layers
    return [layer_kv_cache_spec(hf_config, i, block_size, max_model_len) for i in range(num_layers)]


def group_kv_cache_specs(specs: Sequence[KVCacheSpec]) -> KVCacheConfig:
    """Group layers by spec into groups of equal layer count (see the module docstring).

    Kinds keep their first layer's order (a model's first layer comes first); within a
    kind, layers go to groups in index order."""
    if not specs:
        raise ValueError("a model needs at least one attention layer to have a KV cache")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(index)
    if len(by_spec) == 1:
        ((spec, layers),) = by_spec.items()
        return KVCacheConfig((KVCacheGroupSpec(tuple(layers), spec),))
    size = min(len(layers) for layers in by_spec.values())
    groups = [
        KVCacheGroupSpec(tuple(layers[start : start + size]), spec)
        for spec, layers in by_spec.items()
        for start in range(0, len(layers), size)
    ]
    return KVCacheConfig(tuple(groups))


def kv_cache_config_of(hf_config: Any, block_size: int, max_model_len: int, use_mla: bool = False) -> KVCacheConfig:
    """The model's KV-cache groups (MLA models: one full-attention group)."""
    if use_mla:
        num_layers = _text_config(hf_config).num_hidden_layers
        return KVCacheConfig((KVCacheGroupSpec(tuple(range(num_layers)), FullAttentionSpec(block_size)),))
    return group_kv_cache_specs(layer_kv_cache_specs(hf_config, block_size, max_model_len))


def engine_kv_cache_config(config: EngineConfig) -> KVCacheConfig:
    """The KV-cache groups of an engine's model at its block size and ``max_model_len``."""
    return kv_cache_config_of(
        config.model.hf_config, config.cache.block_size, config.model.max_model_len, config.model.use_mla
    )
