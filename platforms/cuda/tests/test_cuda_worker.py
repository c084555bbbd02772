"""The CUDA worker's KV-cache sizing, driven on the CPU with torch.cuda's memory calls
stubbed: the profiling forward must run before the KV cache exists (the order a real
engine start uses) and the budget must follow gpu_memory_utilization.

The CPU platform is forced (``KVLOOM_PLATFORM=cpu``) so that the same tests run on a GPU
machine too: there the CUDA platform would otherwise be resolved and offer its Triton
kernels to a model that these tests keep on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.interfaces import Worker
from kvloom.testing import ModelRunner, fresh_plugins, make_worker, resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir

GiB = 2**30


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVLOOM_PLATFORM", "cpu")
    with fresh_plugins():
        yield


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    # A small fake device, so the KV cache it sizes fits in this machine's memory.
    state = {"peak": 1 * GiB, "free": 3 * GiB, "total": 4 * GiB, "reserved": GiB // 2}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: state["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (state["free"], state["total"]))
    return state


def _worker(**kwargs):
    from kvloom_platform_cpu.platform import CpuPlatform
    from kvloom_platform_cuda.worker import CUDAWorker

    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=32,
                                   max_num_batched_tokens=512, **kwargs)
    worker = make_worker(CUDAWorker, config, CpuPlatform)  # the CPU device stands in for the GPU
    worker.model_runner = None
    Worker.init_device(worker)  # the generic part (no torch.cuda.set_device)
    worker.load_model()
    return worker


def test_profile_runs_before_the_cache_exists_and_sizes_it(fake_cuda_memory):
    worker = _worker(gpu_memory_utilization=0.5)
    assert worker.runner.builder is None and not worker.runner.kv_caches
    fake_cuda_memory["reserved"] = GiB - 256 * 2**20  # 4 - 3 - 0.75 GiB: 256 MiB not torch's
    budget = worker.kv_cache_budget_bytes()
    # 0.5 * 4 GiB - 1 GiB peak - 256 MiB non-torch - 512 MiB reserve
    assert budget == 2 * GiB - GiB - 256 * 2**20 - 512 * 2**20
    # the profiling cache is gone again; the real one comes next
    assert worker.runner.builder is None and not worker.runner.kv_caches
    worker.initialize_cache(worker.determine_num_kv_blocks())
    assert worker.runner.kv_caches and worker.runner.builder is not None


def test_no_memory_left_is_a_clear_error(fake_cuda_memory):
    fake_cuda_memory["peak"] = 3 * GiB
    worker = _worker(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="No memory left for the KV cache"):
        worker.kv_cache_budget_bytes()


def test_explicit_kv_cache_memory_skips_profiling(fake_cuda_memory):
    worker = _worker(kv_cache_memory="1GiB")
    fake_cuda_memory["peak"] = 10**15  # would fail if profiling ran
    assert worker.kv_cache_budget_bytes() == GiB


def test_engine_start_profiles_through_the_runner_then_serves(fake_cuda_memory, monkeypatch):
    """A whole engine start with the CUDA worker on the CPU: the profile runs on the
    runner's temporary cache, the real cache is sized from it, and generation matches the
    plain CPU engine."""
    from kvloom_platform_cpu.platform import CpuPlatform
    from kvloom_platform_cuda.worker import CUDAWorker

    class CpuStandInCUDAWorker(CUDAWorker):
        def init_device(self) -> None:
            Worker.init_device(self)  # the generic part (no torch.cuda.set_device)

    profiles = []
    profile = ModelRunner.profile_peak_memory

    def spy_profile(self, memory):
        profiles.append(memory)
        return profile(self, memory)

    model = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    plain = LLM(model, dtype="float32", kv_cache_memory="32MiB").generate(prompts, params, use_tqdm=False)

    monkeypatch.setattr(ModelRunner, "profile_peak_memory", spy_profile)
    monkeypatch.setattr(CpuPlatform, "get_worker_cls", classmethod(lambda cls: CpuStandInCUDAWorker))
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched platform lives in this process
    llm = LLM(model, dtype="float32", gpu_memory_utilization=0.51)
    worker = llm.llm_engine.engine_core.core.worker
    assert isinstance(worker, CpuStandInCUDAWorker) and profiles == [torch.cuda]
    # 0.51 * 4 GiB - 1 GiB peak - 0.5 GiB non-torch - 512 MiB reserve
    budget = int(4 * GiB * 0.51) - GiB - GiB // 2 - 512 * 2**20
    assert llm.config.cache.num_blocks == budget // worker.runner.kv_cache_bytes_per_block()
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]


def test_warm_up_captures_graphs_through_the_runner(monkeypatch):
    # The worker warms up, then asks the runner for its graphs; the runner's dispatcher
    # decides which (none for a resolved mode NONE: tests/compilation/test_dispatcher.py).
    worker = _worker()
    worker.initialize_cache(8)
    calls = []
    forward = worker.runner.dummy_forward
    monkeypatch.setattr(worker.runner, "dummy_forward", lambda *a: calls.append("warm-up") or forward(*a))
    monkeypatch.setattr(worker.runner, "capture_cudagraphs", lambda: calls.append("capture"))
    worker.compile_or_warm_up_model()
    assert calls == ["warm-up", "capture"]
    torch.cuda.empty_cache()
