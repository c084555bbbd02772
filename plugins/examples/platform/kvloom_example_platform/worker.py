"""ExampleWorker: kvloom's generic torch worker, plus this device's setup and memory budget."""

from __future__ import annotations

import logging
import os

import torch

from kvloom.interfaces import Worker

logger = logging.getLogger(__name__)

KV_CACHE_ENV = "KVLOOM_EXAMPLE_PLATFORM_KV_CACHE_MIB"


class ExampleWorker(Worker):
    def init_device(self) -> None:
        super().init_device()  # seeds torch, builds the model runner on self.device
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        logger.info("example_cpu worker on %s: %d torch threads", self.device, torch.get_num_threads())

    def kv_cache_budget_bytes(self) -> int:
        # A vendor asks its device how much memory is free; --kv-cache-memory still wins.
        if self.config.cache.kv_cache_memory:
            return self.config.cache.kv_cache_memory
        return int(os.environ.get(KV_CACHE_ENV, "64")) * 2**20
