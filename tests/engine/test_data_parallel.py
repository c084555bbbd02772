"""Data parallelism (``data_parallel_size``): N engine core processes, requests balanced
among them by load (``engine/load_balancer.py``), offline through ``LLM``; how each
platform gives a replica its device; the flag's validation. The server with several
engine cores: tests/entrypoints/openai/test_data_parallel_server.py."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from kvloom_platform_cpu.platform import CpuPlatform
from kvloom_platform_cpu.worker import THREADS_ENV
from kvloom_platform_cuda.platform import CudaPlatform

from kvloom import LLM, SamplingParams
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.load_balancer import LoadBalancer
from kvloom.entrypoints.cli.main import main
from kvloom.outputs import EngineLoad
from tests.helpers.model_fixtures import random_prompts, tiny_model_dir

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(320, lengths=(5, 16, 23, 41, 64, 7, 30, 12))]


def engine_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvloom-engine-core")]


# ----------------------------------------------------------------- balancing


def test_load_balancer_picks_the_lowest_score_and_spreads_a_burst() -> None:
    lb = LoadBalancer(3)
    assert [lb.choose() for _ in range(6)] == [0, 1, 2, 0, 1, 2]  # nothing known yet: a burst spreads
    # score = 4 * waiting + running: 1 waiting (4) weighs more than 3 running (3).
    lb.update(0, EngineLoad(num_waiting=1, num_running=0, kv_cache_usage=0.1))
    lb.update(1, EngineLoad(num_waiting=0, num_running=3, kv_cache_usage=0.1))
    lb.update(2, EngineLoad(num_waiting=0, num_running=5, kv_cache_usage=0.1))
    assert lb.choose() == 1  # 3 < 4 < 5; now engine 1 has one more waiting (7)
    assert lb.choose() == 0  # 4
    assert lb.choose() == 2  # 5 < 7 < 8
    # Equal scores: the engine with the least KV cache in use.
    lb.update(0, EngineLoad(0, 2, 0.5))
    lb.update(1, EngineLoad(0, 2, 0.2))
    lb.update(2, EngineLoad(0, 2, 0.9))
    assert lb.choose() == 1
    assert lb.sent == [3, 4, 3]


def test_offline_data_parallel_gives_the_tokens_of_one_engine() -> None:
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    one = LLM(model, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    expected = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in one.generate(PROMPTS, greedy)]
    one.llm_engine.shutdown()

    llm = LLM(model, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True, data_parallel_size=2)
    client = llm.llm_engine.engine_core
    assert sorted(p.name for p in engine_processes()) == ["kvloom-engine-core-0", "kvloom-engine-core-1"]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, greedy)]
    assert client.balancer.sent == [4, 4]  # both engines got requests (a batch spreads evenly)
    for (tokens, logprobs), (tokens_1, logprobs_1) in zip(got, expected):
        assert tokens == tokens_1
        for step, step_1 in zip(logprobs, logprobs_1):
            assert step.keys() == step_1.keys()
            assert all(abs(step[t].logprob - step_1[t].logprob) < 1e-4 for t in step)
    # Utilities reach every engine core; n > 1 and aborts work across them.
    assert llm.llm_engine.reset_prefix_cache() is True and llm.llm_engine.list_loras() == set()
    assert client.call_utility("core_state")["num_unfinished_requests"] == 0
    sampled = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5))[0]
    assert len(sampled.outputs) == 3
    llm.llm_engine.add_request("gone", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    llm.llm_engine.step()
    llm.llm_engine.abort_request("gone")
    assert not llm.llm_engine.has_unfinished_requests()
    assert client._engine_of == {}  # every request the client routed has finished
    llm.llm_engine.shutdown()
    assert not engine_processes()


# ----------------------------------------------------------------- devices and validation


def test_cpu_replicas_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    cores = len(os.sched_getaffinity(0))
    assert CpuPlatform.data_parallel_env(1, 2) == {THREADS_ENV: str(max(1, cores // 2))}
    assert CpuPlatform.data_parallel_env(0, 4 * cores) == {THREADS_ENV: "1"}
    monkeypatch.setenv(THREADS_ENV, "3")  # the user's count, for each replica
    assert CpuPlatform.data_parallel_env(1, 2) == {}


def test_cuda_replicas_get_one_visible_gpu_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert [CudaPlatform.data_parallel_env(i, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4"},
                                                                       {"CUDA_VISIBLE_DEVICES": "6"}]  # fmt: skip
    with pytest.raises(ValueError, match=r"--data-parallel-size: 3 replicas need one GPU each; 2 visible \(allowed: 1\.\.2\)"):
        CudaPlatform.data_parallel_env(0, 3)


def test_data_parallel_size_is_validated(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--data-parallel-size", "0"])
    assert info.value.code == 2
    assert "--data-parallel-size: Input should be greater than or equal to 1" in capsys.readouterr().err
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="--data-parallel-size 2 needs the engine cores in processes of their own"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", data_parallel_size=2)
