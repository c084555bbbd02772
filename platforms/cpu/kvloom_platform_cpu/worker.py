"""The CPU worker: kvloom's generic torch worker, with torch's thread count from
``KVLOOM_CPU_THREADS`` when it is set to a positive integer (``torch.set_num_threads``,
process-wide, before the model runner is built); unset or empty, torch's default stays
(its intra-op threads: the cores it sees, or ``OMP_NUM_THREADS``). Any other value is a
``ValueError`` naming the variable."""

from __future__ import annotations

import os

import torch

from kvloom.interfaces import Worker

KVLOOM_PLUGIN_API = "1.0"

#: Environment variable: the number of torch threads the CPU worker runs with.
THREADS_ENV = "KVLOOM_CPU_THREADS"


class CpuWorker(Worker):
    def init_device(self) -> None:
        threads = os.environ.get(THREADS_ENV, "").strip()
        if threads:
            if not threads.isdigit() or int(threads) < 1:
                raise ValueError(f"{THREADS_ENV} must be a positive integer, got {threads!r}")
            torch.set_num_threads(int(threads))
        super().init_device()
