"""The KV cache's memory: its dtype, the bytes one block takes over all layers, the
per-layer allocation, the attention metadata builder that reads it, and the memory
profile that sizes it on devices with a memory budget.

Every KV-cache buffer is one tensor in the selected backend's layout
(``AttentionBackend.get_kv_cache_shape``). A model with one KV-cache group has one buffer
per attention layer; a hybrid model's layers of different groups share buffers
(``kvloom.worker.kv_cache_groups``), so one block takes a buffer's page in each of them,
and a sliding-window group holding a request's window only is what saves memory.
``MLAAttention`` layers hold a latent cache (one KV "head" of ``kv_lora_rank +
qk_rope_head_dim`` values per token); the code here treats both alike.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from kvloom.attention.kv_quant import kv_cache_torch_dtype
from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.attention.mla_metadata import MLAMetadataBuilder
from kvloom.config import EngineConfig
from kvloom.kv_cache.spec import engine_kv_cache_config
from kvloom.platforms.worker import DeviceMemory
from kvloom.worker.kv_cache_groups import KVCacheGroups

logger = logging.getLogger(__name__)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache. On the host it is left uninitialised: zero-filling touches
    every page (seconds and the whole cache in RSS at start); the attention backends
    never read a slot before writing it (their masks hide the rest, and
    tests/worker/test_kv_cache_uninitialised.py checks it with NaN-filled caches).
    Device memory is cleared, as it is cheap there."""
    if device.type == "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def measure_peak_memory(memory: DeviceMemory, run: Callable[[], None]) -> int:
    """Torch's peak allocated bytes (``memory.max_memory_allocated()``) over ``run()``;
    what ``run`` left cached is released afterwards."""
    memory.synchronize()
    memory.reset_peak_memory_stats()
    run()
    memory.synchronize()
    peak = memory.max_memory_allocated()
    gc.collect()
    memory.empty_cache()
    return peak


class KVCacheMemory:
    """The KV cache of one model's attention layers on one device."""

    def __init__(self, config: EngineConfig, device: torch.device, attn_layers: list[Attention | MLAAttention]) -> None:
        self.config = config
        self.device = device
        self.attn_layers = attn_layers
        self.backend = config.attention.backend
        self.block_size = config.cache.block_size
        #: ``--kv-cache-dtype``, or the model's for "auto".
        self.dtype: torch.dtype = kv_cache_torch_dtype(config.cache.cache_dtype, config.model.dtype)
        #: The layers by KV-cache group and by buffer.
        self.groups = KVCacheGroups(engine_kv_cache_config(config), attn_layers)

    def bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all buffers (for sizing the cache)."""
        per_buffer = [
            int(np.prod(self.backend.get_kv_cache_shape(1, self.block_size, a.num_kv_heads, a.head_size)))
            for a in (buffer[0] for buffer in self.groups.buffers)
        ]
        return sum(per_buffer) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate each buffer of ``num_blocks`` blocks and hand it to its layers."""
        caches = []
        for buffer in self.groups.buffers:
            first = buffer[0]
            shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size, first.num_kv_heads, first.head_size)
            cache = allocate_kv_cache(shape, self.dtype, self.device)
            for layer in buffer:
                layer.kv_cache = cache
            caches.append(cache)
        return caches

    def release(self) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)

    def make_builder(
        self,
        max_blocks_per_req: int,
        group_metadata: Callable[[CommonAttentionMetadata], list[CommonAttentionMetadata]] | None = None,
    ) -> Any:
        """The backend's metadata builder for these layers (for MLA models the core's
        builder, which asks each phase backend's builder for its part); with several
        KV-cache groups one per group behind a ``GroupedMetadataBuilder``, which takes each
        group's view of a step from ``group_metadata`` (``StepInputs.group_metadata``)."""
        if self.groups.num_groups > 1 and group_metadata is None:
            raise ValueError("a model with several KV-cache groups needs group_metadata to build its metadata")

        def group_builder(group: int, first: Attention | MLAAttention) -> Any:
            return self._make_group_builder(max_blocks_per_req, first, self.groups.window_of_group(group))

        return self.groups.make_builder(group_builder, group_metadata or (lambda common: [common]))

    def make_draft_builder(self, max_blocks_per_req: int, layers: list[Any]) -> Any:
        """The metadata builder of a speculative draft model's layers (a shape of their own;
        one group of full attention: speculation runs on single-group models only)."""
        return self._make_group_builder(max_blocks_per_req, layers[0], None)

    def _make_group_builder(self, max_blocks_per_req: int, first: Attention | MLAAttention, window: int | None) -> Any:
        config = self.config
        spec = AttentionLayerSpec(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=config.model.dtype,
            kv_cache_dtype=self.dtype,
            block_size=self.block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=config.model.max_model_len,
            scale=first.scale,
            extra=first.dims.to_extra() if isinstance(first, MLAAttention) else {},
            sliding_window=window,
            logits_soft_cap=getattr(first, "logits_soft_cap", None),
        )
        if isinstance(first, MLAAttention):
            return MLAMetadataBuilder(spec, self.device, max_blocks_per_req, first.backend, first.prefill_backend)
        return self.backend.get_builder_cls()(spec, self.device, max_blocks_per_req)

    def log_size(self, num_blocks: int) -> None:
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s) for %d layers in %d buffers (%s)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.bytes_per_block() / 2**30,
            str(self.dtype).removeprefix("torch."),
            len(self.attn_layers),
            len(self.groups.buffers),
            self.groups.config.describe(),
        )
