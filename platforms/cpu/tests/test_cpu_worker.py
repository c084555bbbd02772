"""The CPU platform's worker: the generic worker, with torch's thread count from
``KVLOOM_CPU_THREADS`` when it is set (a positive integer; anything else is an error
naming the variable), else from the cores the process may use; and a KV cache sized from
the scheduler's limits and the machine's memory."""

from __future__ import annotations

import pytest
import torch
from kvloom_platform_cpu.platform import CpuPlatform
from kvloom_platform_cpu import worker as cpu_worker
from kvloom_platform_cpu.worker import CpuWorker

from kvloom.testing import make_worker, resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def _init_worker(**engine_args) -> CpuWorker:
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32", **engine_args)
    assert CpuPlatform.get_worker_cls() is CpuWorker
    worker = make_worker(CpuWorker, config, CpuPlatform)
    worker.init_device()
    assert worker.model_runner is not None
    return worker


def test_cpu_threads_env_sets_torchs_thread_count(monkeypatch, restore_threads):
    wanted = 1 if restore_threads != 1 else 2
    monkeypatch.setenv("KVLOOM_CPU_THREADS", str(wanted))
    _init_worker()
    assert torch.get_num_threads() == wanted


@pytest.mark.parametrize("value", [None, ""])
def test_without_the_env_threads_follow_the_cores_the_process_may_use(monkeypatch, restore_threads, value):
    """Not torch's default (all the host's cores): the process's CPU affinity."""
    if value is None:
        monkeypatch.delenv("KVLOOM_CPU_THREADS", raising=False)
    else:
        monkeypatch.setenv("KVLOOM_CPU_THREADS", value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_worker.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    for cores in ({0}, {0, 1, 2}):
        monkeypatch.setattr(cpu_worker.os, "sched_getaffinity", lambda pid, cores=cores: cores)
        _init_worker()
        assert torch.get_num_threads() == len(cores)


def test_a_loaded_machine_gets_fewer_threads(monkeypatch, restore_threads):
    """Threads sharing cores with other busy processes stall each other: the cores the
    1-minute load average keeps busy are left out (at least one thread)."""
    monkeypatch.delenv("KVLOOM_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_worker.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for load, threads in ((1.2, 3), (3.6, 1), (9.0, 1)):
        monkeypatch.setattr(cpu_worker.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        _init_worker()
        assert torch.get_num_threads() == threads


def test_omp_num_threads_is_left_to_torch(monkeypatch, restore_threads):
    monkeypatch.delenv("KVLOOM_CPU_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cpu_worker.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    _init_worker()
    assert torch.get_num_threads() == restore_threads


@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(monkeypatch, restore_threads, value):
    monkeypatch.setenv("KVLOOM_CPU_THREADS", value)
    with pytest.raises(ValueError, match=f"KVLOOM_CPU_THREADS must be a positive integer, got '{value}'"):
        _init_worker()
    assert torch.get_num_threads() == restore_threads


def _budget_blocks(worker: CpuWorker) -> int:
    worker.load_model()
    return worker.determine_num_kv_blocks()


def test_kv_cache_holds_max_num_seqs_requests_of_max_model_len(monkeypatch, restore_threads):
    """Not a fixed 2 GiB: 3 requests of 64 tokens in blocks of 16 are 12 blocks."""
    monkeypatch.setenv("KVLOOM_CPU_THREADS", "1")
    worker = _init_worker(max_num_seqs=3, max_model_len=64, block_size=16)
    assert _budget_blocks(worker) == 12


def test_kv_cache_is_capped_by_the_available_memory(monkeypatch, restore_threads):
    monkeypatch.setenv("KVLOOM_CPU_THREADS", "1")
    worker = _init_worker(max_num_seqs=256, max_model_len=64, block_size=16)
    worker.load_model()
    per_block = worker.runner.kv_cache_bytes_per_block()
    monkeypatch.setattr(cpu_worker, "available_host_memory", lambda: 40 * per_block)
    assert worker.determine_num_kv_blocks() == int(40 * per_block * cpu_worker.HOST_KV_CACHE_FRACTION) // per_block


def test_kv_cache_memory_flag_still_wins(monkeypatch, restore_threads):
    monkeypatch.setenv("KVLOOM_CPU_THREADS", "1")
    worker = _init_worker(max_num_seqs=1, max_model_len=16, block_size=16, kv_cache_memory="8MiB")
    worker.load_model()
    assert worker.determine_num_kv_blocks() == 8 * 2**20 // worker.runner.kv_cache_bytes_per_block()
