"""The KV cache's memory: its dtype, the bytes one block takes over all layers, the
per-layer allocation, the attention metadata builder that reads it, and the memory
profile that sizes it on devices with a memory budget.

Every attention layer gets one tensor in the selected backend's layout
(``AttentionBackend.get_kv_cache_shape``). ``MLAAttention`` layers hold a latent cache (one
KV "head" of ``kv_lora_rank + qk_rope_head_dim`` values per token); the code here treats
both alike.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvloom.attention.backend import AttentionLayerSpec
from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.attention.mla_metadata import MLAMetadataBuilder
from kvloom.config import EngineConfig
from kvloom.platforms.worker import DeviceMemory

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
        name = config.cache.cache_dtype
        #: ``--kv-cache-dtype``, or the model's for "auto".
        self.dtype: torch.dtype = config.model.dtype if name == "auto" else getattr(torch, name)

    def bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all attention layers (for sizing the cache)."""
        per_layer = [
            int(np.prod(self.backend.get_kv_cache_shape(1, self.block_size, a.num_kv_heads, a.head_size)))
            for a in self.attn_layers
        ]
        return sum(per_layer) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate each layer's cache of ``num_blocks`` blocks and hand it to the layer."""
        caches = []
        for layer in self.attn_layers:
            shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = cache = allocate_kv_cache(shape, self.dtype, self.device)
            caches.append(cache)
        return caches

    def release(self) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)

    def make_builder(self, max_blocks_per_req: int, layers: list[Any] | None = None) -> Any:
        """The backend's metadata builder for these layers (for MLA models the core's
        builder, which asks each phase backend's builder for its part); ``layers``: a
        subset with a shape of their own (a speculative draft model's), else the model's."""
        first = (layers or self.attn_layers)[0]
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
        )
        if isinstance(first, MLAAttention):
            return MLAMetadataBuilder(spec, self.device, max_blocks_per_req, first.backend, first.prefill_backend)
        return self.backend.get_builder_cls()(spec, self.device, max_blocks_per_req)

    def log_size(self, num_blocks: int) -> None:
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB, %s) for %d layers",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block() / 2**30,
            str(self.dtype).removeprefix("torch."),
            len(self.attn_layers),
        )
