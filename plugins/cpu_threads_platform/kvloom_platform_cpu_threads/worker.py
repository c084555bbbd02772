"""CpuThreadsWorker: kvloom's generic torch worker, with the platform's thread count."""

from __future__ import annotations

import logging
import os

import torch

from kvloom.interfaces import Worker
from kvloom_platform_cpu_threads.threads import configured_threads

logger = logging.getLogger(__name__)


class CpuThreadsWorker(Worker):
    def init_device(self) -> None:
        super().init_device()
        threads = configured_threads()
        if threads is None:
            raise RuntimeError("the cpu_threads platform runs only with KVLOOM_CPU_THREADS_PLATFORM set")
        torch.set_num_threads(threads)
        logger.info("cpu_threads worker: %d torch threads (pid %d)", torch.get_num_threads(), os.getpid())
