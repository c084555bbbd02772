"""The model runner's side of the KV-cache groups (``kvloom.kv_cache.spec``): which of this
rank's attention layers belong to which group, which layers share a buffer, and the
metadata builders per group.

The groups come from the model config (``engine_kv_cache_config``), exactly as the
scheduler derives them, so the block ids a step carries per group index the same layers
here. Each layer's group is found from its decoder-layer index (``model.layers.<i>.`` in
its prefix) and checked against the layer itself: its sliding window must be its group's
(a model whose layers disagree with its config is an error naming the layer, not a silent
mismatch between the blocks kept and the positions read).

Buffers (the seeds' memory layout): a hybrid model's groups have ``group_size`` layer
slots each; buffer ``j`` is shared by the ``j``-th layer of every group, which is safe
because a block id belongs to one group at a time. Layers sharing a buffer must have the
same KV shape (one page size). A model with one group has one buffer per layer: the plain
paged cache.

Metadata: one builder per group (each knows its group's window), and
``GroupedMetadataBuilder`` builds every group's metadata of a step as a list, indexed by
the layers' ``kv_cache_group_id``. A model with one group uses its builder directly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from kvloom.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)

#: The decoder-layer index in an attention layer's prefix (``model.layers.3.self_attn.attn``).
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index_of(prefix: str) -> int | None:
    """The decoder-layer index in a layer prefix, or None."""
    match = _LAYER_INDEX.search(prefix)
    return int(match.group(1)) if match else None


def _window_of(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


class KVCacheGroups:
    """This rank's attention layers arranged by KV-cache group and buffer."""

    def __init__(self, kv_cache_config: KVCacheConfig, attn_layers: Sequence[Attention | MLAAttention]) -> None:
        self.config = kv_cache_config
        self.num_groups = kv_cache_config.num_groups
        if self.num_groups == 1:
            # One group: every layer reads the step's metadata itself, one buffer each.
            self.layers_of_group: list[list[Attention | MLAAttention]] = [list(attn_layers)]
            self.buffers: list[list[Attention | MLAAttention]] = [[layer] for layer in attn_layers]
            self._check_windows(attn_layers, [kv_cache_config.groups[0].kv_cache_spec] * len(attn_layers))
            return
        where = kv_cache_config.group_of_layer()
        self.layers_of_group = [[] for _ in range(self.num_groups)]
        slots: dict[int, list[Attention | MLAAttention]] = {}
        specs = []
        for layer in attn_layers:
            index = layer_index_of(layer.prefix)
            if index is None or index not in where:
                raise RuntimeError(
                    f"attention layer {layer.prefix!r}: a model with several KV-cache groups "
                    f"({kv_cache_config.describe()}) needs its decoder-layer index in the layer prefix "
                    "('model.layers.<i>.' with i < num_hidden_layers)"
                )
            group, slot = where[index]
            if isinstance(layer, Attention):
                layer.kv_cache_group_id = group
            else:
                raise RuntimeError(f"{layer.prefix}: MLA layers have one KV-cache group")
            self.layers_of_group[group].append(layer)
            slots.setdefault(slot, []).append(layer)
            specs.append(kv_cache_config.groups[group].kv_cache_spec)
        self._check_windows(attn_layers, specs)
        self.buffers = [slots[slot] for slot in sorted(slots)]
        for buffer in self.buffers:
            shapes = {(layer.num_kv_heads, layer.head_size) for layer in buffer}
            if len(shapes) > 1:
                names = ", ".join(layer.prefix for layer in buffer)
                raise RuntimeError(f"layers {names} share a KV-cache buffer but differ in (num_kv_heads, head_size): "
                                   f"{sorted(shapes)}; kvloom's hybrid KV cache needs one page size")  # fmt: skip

    @staticmethod
    def _check_windows(layers: Sequence[Attention | MLAAttention], specs: Sequence[KVCacheSpec]) -> None:
        for layer, spec in zip(layers, specs):
            if isinstance(spec, ChunkedLocalAttentionSpec):
                raise NotImplementedError(
                    f"{layer.prefix}: chunked local attention (attention_chunk_size={spec.attention_chunk_size}) has "
                    "KV-cache groups but no attention backend computes it yet"
                )
            window = getattr(layer, "sliding_window", None)
            if window != _window_of(spec):
                raise RuntimeError(
                    f"attention layer {layer.prefix!r} has sliding_window={window}, but the model config gives its "
                    f"layer {spec.describe()}: the model class and its config disagree"
                )

    def make_builder(
        self,
        make_group_builder: Callable[[int, Attention | MLAAttention], AttentionMetadataBuilder],
        group_metadata: Callable[[CommonAttentionMetadata], list[CommonAttentionMetadata]],
    ) -> Any:
        """The step's metadata builder: the group's own with one group, else a
        ``GroupedMetadataBuilder`` over one builder per group (``make_group_builder(group,
        first layer of the group)``; a group with no layer on this rank gets the first
        group's, its metadata is never read)."""
        if self.num_groups == 1:
            return make_group_builder(0, self.layers_of_group[0][0])
        fallback = next(layers[0] for layers in self.layers_of_group if layers)
        builders = [make_group_builder(g, layers[0] if layers else fallback) for g, layers in
                    enumerate(self.layers_of_group)]  # fmt: skip
        return GroupedMetadataBuilder(builders, group_metadata)

    def window_of_group(self, group: int) -> int | None:
        return _window_of(self.config.groups[group].kv_cache_spec)


class GroupedMetadataBuilder:
    """One metadata builder per KV-cache group behind the builder interface: ``build``
    returns the step's metadata of every group (a list; each layer reads its group's)."""

    def __init__(
        self,
        builders: list[AttentionMetadataBuilder],
        group_metadata: Callable[[CommonAttentionMetadata], list[CommonAttentionMetadata]],
    ) -> None:
        self.builders = builders
        self.group_metadata = group_metadata

    def build(self, common: CommonAttentionMetadata) -> list[Any]:
        return [b.build(c) for b, c in zip(self.builders, self.group_metadata(common))]

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> list[Any]:
        return [b.build_for_cudagraph_capture(c) for b, c in zip(self.builders, self.group_metadata(common))]
