"""The CPU worker: kvloom's generic torch worker, with torch's thread count from
``KVLOOM_CPU_THREADS`` when it is set (torch's default otherwise)."""

from __future__ import annotations

import os

import torch

from kvloom.interfaces import Worker

KVLOOM_PLUGIN_API = "1.0"

#: Environment variable: the number of torch threads the CPU worker runs with.
THREADS_ENV = "KVLOOM_CPU_THREADS"


class CpuWorker(Worker):
    def init_device(self) -> None:
        threads = os.environ.get(THREADS_ENV)
        if threads:
            torch.set_num_threads(int(threads))
        super().init_device()
