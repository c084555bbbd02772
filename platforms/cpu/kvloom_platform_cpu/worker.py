"""The CPU worker: kvloom's generic torch worker with two host-specific choices.

Threads: torch's intra-op thread count is ``KVLOOM_CPU_THREADS`` when it is set to a
positive integer (any other value is a ``ValueError`` naming the variable); unset or
empty, it is the number of cores this process may run on (``os.sched_getaffinity``), so
a process pinned to 2 cores of a 64-core host (taskset, a container's cpuset) does not
run 64 threads that fight over them, less the machine's 1-minute load average (at least
1: oversubscribed torch threads stall each other); ``OMP_NUM_THREADS``, when set, is
left to torch.
``torch.set_num_threads`` is process-wide and runs before the model runner is built.

KV cache: without ``--kv-cache-memory`` (or ``--num-gpu-blocks-override``) it holds what
the scheduler can ask for, ``--max-num-seqs`` requests of ``--max-model-len`` tokens, but
at most ``HOST_KV_CACHE_FRACTION`` of the memory the machine has available; it is
allocated uninitialised (``allocate_kv_cache``), so its pages cost memory only once used.
"""

from __future__ import annotations

import logging
import os

import torch

from kvloom.interfaces import Worker, available_host_memory

KVLOOM_PLUGIN_API = "1.0"

logger = logging.getLogger(__name__)

#: Environment variable: the number of torch threads the CPU worker runs with.
THREADS_ENV = "KVLOOM_CPU_THREADS"

#: The most of the available host memory the KV cache takes by default (the model's
#: weights, activations and the rest of the machine need the remainder).
HOST_KV_CACHE_FRACTION = 0.25


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # platforms without sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def idle_cores(cores: int) -> int:
    """Of ``cores``, those the rest of the machine leaves idle: ``cores`` minus the
    1-minute load average (rounded), at least 1. torch's threads wait for each other at
    every op, so one thread that shares its core with another busy process stalls them
    all (measured: decode 10x slower with 2 threads than with 1 on a 2-core machine at
    load 5)."""
    return max(1, min(cores, round(cores - _load_average())))


def cpu_thread_count() -> int | None:
    """The torch thread count the CPU worker sets: ``KVLOOM_CPU_THREADS``, else the usable
    cores the machine's load leaves idle; None when ``OMP_NUM_THREADS`` is set (torch
    already follows it)."""
    threads = os.environ.get(THREADS_ENV, "").strip()
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {threads!r}")
        return int(threads)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return idle_cores(usable_cores())


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


class CpuWorker(Worker):
    def init_device(self) -> None:
        threads = cpu_thread_count()
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        # os.getloadavg is system-wide (a container sees its host's load); the log says
        # what was chosen and how to override it.
        logger.info(
            "CPU worker: %d torch threads (%d usable cores, load average %.1f; %s sets it)",
            torch.get_num_threads(), usable_cores(), _load_average(), THREADS_ENV,
        )  # fmt: skip
        super().init_device()

    def kv_cache_budget_bytes(self) -> int:
        if self.config.cache.kv_cache_memory:
            return self.config.cache.kv_cache_memory
        scheduler, block_size = self.config.scheduler, self.config.cache.block_size
        per_block = self.runner.kv_cache_bytes_per_block()
        wanted = scheduler.max_num_seqs * -(-scheduler.max_model_len // block_size) * per_block  # ceil
        cap = int(available_host_memory() * HOST_KV_CACHE_FRACTION)
        if wanted > cap:
            logger.info(
                "KV cache: %d requests of %d tokens (--max-num-seqs x --max-model-len) would take %.2f GiB; "
                "using %.2f GiB (%d%% of the available memory; --kv-cache-memory sets it)",
                scheduler.max_num_seqs, scheduler.max_model_len, wanted / 2**30, cap / 2**30,
                round(HOST_KV_CACHE_FRACTION * 100),
            )  # fmt: skip
        return min(wanted, cap)
