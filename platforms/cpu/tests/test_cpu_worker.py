"""The CPU platform's worker: the generic worker, with torch's thread count from
``KVLOOM_CPU_THREADS`` when it is set (a positive integer; anything else is an error
naming the variable)."""

from __future__ import annotations

import pytest
import torch
from kvloom_platform_cpu.platform import CpuPlatform
from kvloom_platform_cpu.worker import CpuWorker

from kvloom.testing import resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def _init_worker() -> CpuWorker:
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32")
    assert CpuPlatform.get_worker_cls() is CpuWorker
    worker = CpuWorker(config, CpuPlatform)
    worker.init_device()
    assert worker.model_runner is not None
    return worker


def test_cpu_threads_env_sets_torchs_thread_count(monkeypatch, restore_threads):
    wanted = 1 if restore_threads != 1 else 2
    monkeypatch.setenv("KVLOOM_CPU_THREADS", str(wanted))
    _init_worker()
    assert torch.get_num_threads() == wanted


@pytest.mark.parametrize("value", [None, ""])
def test_without_the_env_torchs_threads_stay(monkeypatch, restore_threads, value):
    if value is None:
        monkeypatch.delenv("KVLOOM_CPU_THREADS", raising=False)
    else:
        monkeypatch.setenv("KVLOOM_CPU_THREADS", value)
    _init_worker()
    assert torch.get_num_threads() == restore_threads


@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(monkeypatch, restore_threads, value):
    monkeypatch.setenv("KVLOOM_CPU_THREADS", value)
    with pytest.raises(ValueError, match=f"KVLOOM_CPU_THREADS must be a positive integer, got '{value}'"):
        _init_worker()
    assert torch.get_num_threads() == restore_threads
