"""Tensor parallelism on the CPU: two gloo ranks (``--distributed-executor-backend mp``).

* TP=2 generates the same greedy tokens as TP=1 on the fp32 tiny models (Llama with the
  engine core in its own process, Qwen3 with it in this process, a Llama with one KV
  head and a vocabulary not divisible by 2: the KV head replicated, the vocabulary padded,
  and the MoE models Qwen3-MoE and Mixtral: experts sharded by their intermediate size);
* ``--load-format dummy`` loads each rank's slices; CPU ranks share the cores;
* a worker rank that raises or dies makes the call (``generate``) raise an error naming
  the rank, with the engine core in this process or in its own, and no process outlives
  the engine;
* the flags are validated against the model and each other.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from kvloom import LLM, SamplingParams
from kvloom.engine.core_client import EngineDeadError
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.executor import multiproc
from kvloom.executor.multiproc import MultiprocExecutor, WorkerRankError
from kvloom.testing import resolve_engine_config
from kvloom.testing.models import save_tiny_checkpoint, tiny_hf_config, tiny_model_dir
from tests.helpers.engine_faults import running_pids

PROMPTS = [[3, 17, 250, 9, 41], [5, 6, 7, 100, 200, 300, 11, 12, 13], [400, 2, 77]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with one KV head (replicated on both ranks), an odd vocabulary (padded
    on the last rank) and tied embeddings (the vocab-parallel head shares the shard)."""
    config = tiny_hf_config("llama", num_key_value_heads=1, vocab_size=515, tie_word_embeddings=True)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("llama_kv1"))


def greedy_tokens(model: str, **engine_args: object) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("model", "core_in_process"),
    [("llama", False), ("qwen3", True), ("llama_kv1", True), ("qwen3_moe", False), ("mixtral", True)],
)
def test_tp2_greedy_tokens_match_tp1(
    model: str, core_in_process: bool, one_kv_head_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if core_in_process:
        monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    path = str(one_kv_head_model if model == "llama_kv1" else tiny_model_dir(model))
    expected = greedy_tokens(path)
    assert len({tuple(t) for t in expected}) > 1  # the prompts do not all collapse to one output
    assert greedy_tokens(path, tensor_parallel_size=2) == expected



def test_killed_rank_raises_naming_it_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              tensor_parallel_size=2)  # fmt: skip
    executor = llm.llm_engine.engine_core.core.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = executor.worker_pids
    assert len(running_pids(pids)) == 2
    segment = f"/dev/shm/{executor._mq.handle.name}"
    assert os.path.exists(segment)
    # A rank that raises answers with its traceback; the error names the rank.
    with pytest.raises(WorkerRankError, match=r"(?s)rank [01] \(pid \d+\) raised in no_such_method:.*AttributeError"):
        executor.collective_rpc("no_such_method")
    # The other rank's late error reply is dropped, not taken for the next call's answer.
    assert executor.collective_rpc("list_loras") == [set(), set()]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerRankError, match=r"rank 1 .*killed by SIGKILL") as info:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30  # seen through the process sentinel, not a collective timeout
    llm.llm_engine.shutdown()
    assert running_pids(pids) == []
    assert not os.path.exists(segment)  # the broadcast queue's shared memory is unlinked


def test_calls_longer_than_a_chunk_keep_their_order_through_the_pipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With chunks of 512 bytes the prefill steps (and the initial calls) overflow to the
    pipes and the decode steps stay in the ring: TP=2 still gives TP=1's tokens."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setattr(multiproc, "MQ_CHUNK_BYTES", 512)
    path = str(tiny_model_dir("qwen3"))
    expected = greedy_tokens(path)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True, tensor_parallel_size=2)
    try:
        queue = llm.llm_engine.engine_core.core.executor._mq
        before, enqueued = queue.n_overflowed, queue.n_enqueued
        outputs = llm.generate(
            [{"prompt_token_ids": PROMPTS[0] * 45}] + [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False
        )
        # Both paths were taken: the prefill went through the pipes, decode steps the ring.
        assert 0 < queue.n_overflowed - before < queue.n_enqueued - enqueued
        assert [list(o.outputs[0].token_ids) for o in outputs[1:]] == expected
    finally:
        llm.llm_engine.shutdown()


def test_dummy_weights_load_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--load-format dummy``: each rank fills its own slices; the engine runs."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    tokens = greedy_tokens(str(tiny_model_dir("qwen3")), tensor_parallel_size=2, load_format="dummy")
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(PROMPTS)


def engine_core_and_ranks(llm: LLM) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine core process of ``llm`` (under this process: its child when spawned, its
    grandchild through the fork server on the CPU) and its two rank processes, its children."""
    core = psutil.Process(llm.llm_engine.engine_core.engine.pid)
    assert core in psutil.Process().children(recursive=True)
    ranks = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    return core, ranks


def test_engine_core_process_shutdown_leaves_no_worker() -> None:
    """With the engine core in its own process, the rank processes are its children:
    shutting the engine down ends all of them."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              tensor_parallel_size=2)  # fmt: skip
    core, ranks = engine_core_and_ranks(llm)
    workers = [p.pid for p in (core, *ranks)]
    llm.llm_engine.shutdown()
    deadline = time.monotonic() + 20
    while running_pids(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_pids(workers) == []


def test_killed_engine_core_leaves_no_worker_and_no_shared_memory() -> None:
    """The engine core process killed without a shutdown: its ranks see it gone, stop and
    unlink the broadcast ring's shared memory."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              tensor_parallel_size=2)  # fmt: skip
    core, ranks = engine_core_and_ranks(llm)
    segments = {m.path for m in ranks[0].memory_maps() if m.path.startswith("/dev/shm/")}
    assert segments and all(os.path.exists(s) for s in segments)
    core.kill()
    pids = [p.pid for p in (core, *ranks)]
    deadline = time.monotonic() + 20
    while (running_pids(pids) or any(os.path.exists(s) for s in segments)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_pids(pids) == []
    assert not any(os.path.exists(s) for s in segments)
    llm.llm_engine.shutdown()


def test_killed_rank_under_an_engine_core_process_kills_the_engine_naming_it() -> None:
    """The engine core in its own process (the default): a rank's death ends the engine
    core, the front end raises ``EngineDeadError`` naming the rank, nothing is left."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              tensor_parallel_size=2, async_scheduling=True)  # fmt: skip
    core, ranks = engine_core_and_ranks(llm)
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    ranks[1].kill()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    pids = [p.pid for p in (core, *ranks)]
    deadline = time.monotonic() + 20
    while running_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_pids(pids) == []


def test_cpu_ranks_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CPU rank gets its share of the torch threads (else every rank takes them all),
    unless KVLOOM_CPU_THREADS is set."""
    from kvloom_platform_cpu.platform import CpuPlatform

    monkeypatch.delenv("KVLOOM_CPU_THREADS", raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert CpuPlatform.tensor_parallel_env(1, 2) == {"KVLOOM_CPU_THREADS": share}
    monkeypatch.setenv("KVLOOM_CPU_THREADS", "3")
    assert CpuPlatform.tensor_parallel_env(1, 2) == {}


def test_flags_parse_and_default_to_mp() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_namespace(
        parser.parse_args(["--model", "m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    )
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "mp")
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2)
    assert config.parallel.distributed_executor_backend == "mp"
    config = resolve_engine_config(model=str(tiny_model_dir("llama")))
    assert config.parallel.distributed_executor_backend == "uni"


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"tensor_parallel_size": 3}, r"tensor_parallel_size: 3 does not divide the model's num_attention_heads \(4\)"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, r"distributed_executor_backend: 'uni'"),
        ({"tensor_parallel_size": 2, "enable_lora": True}, r"enable_lora: True is not supported with tensor_parallel"),
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size"),
    ],
)
def test_bad_flags_are_refused_naming_the_field(engine_args: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_engine_config(model=str(tiny_model_dir("llama")), **engine_args)


def test_moe_intermediate_size_must_divide(tmp_path: Path) -> None:
    """The experts' hidden size (Qwen3-MoE's moe_intermediate_size) is split too."""
    path = save_tiny_checkpoint(tiny_hf_config("qwen3_moe", moe_intermediate_size=33), tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide the model's moe_intermediate_size"):
        resolve_engine_config(model=str(path), tensor_parallel_size=2)
