"""The Ray executor (``--distributed-executor-backend ray``) on a local Ray instance of two
CPUs, started once for the module: two gloo ranks as Ray actors.

* TP=2 through Ray generates the same greedy tokens as TP=1 on the fp32 tiny Llama, with
  the engine core in its own process connecting to the running cluster (``RAY_ADDRESS``);
* PP=2 through Ray (two stages, one actor each) generates the same greedy tokens as PP=1,
  with two micro-batches in flight in the engine core's batch queue;
* an actor that raises or is killed (a TP rank, or the second pipeline stage) makes the
  call raise ``WorkerRankError`` naming the rank, at once (not after a collective timeout);
* shutdown leaves no actor and no placement group: the cluster's resources are all free
  again and the actors' processes are gone;
* without Ray installed, or on a platform that names no Ray resource, the error says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from kvloom import LLM  # noqa: E402
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace  # noqa: E402
from kvloom.executor.multiproc import WorkerRankError  # noqa: E402
from kvloom.executor.ray import RayDistributedExecutor  # noqa: E402
from kvloom.testing import resolve_engine_config  # noqa: E402
from kvloom.testing.models import tiny_model_dir  # noqa: E402
from tests.distributed.test_pipeline_parallel import greedy_tokens as pipelined_greedy_tokens  # noqa: E402
from tests.distributed.test_tensor_parallel import GREEDY, PROMPTS, greedy_tokens  # noqa: E402
from tests.helpers.engine_faults import running_pids  # noqa: E402

NUM_CPUS = 2


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[str]:
    """A local Ray instance for the whole module (starting one takes seconds); its address."""
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()



def assert_nothing_left(pids: list[int] = ()) -> None:  # type: ignore[assignment]
    """No placement group of ours remains, every CPU is free again, the actors' processes
    are gone (Ray releases a killed actor's resources asynchronously: poll a little)."""
    deadline = time.monotonic() + 30
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        free = ray.available_resources().get("CPU", 0.0)
        alive = running_pids(list(pids))
        if (not groups and free == NUM_CPUS and not alive) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert groups == []
    assert free == NUM_CPUS
    assert alive == []


def test_ray_tp2_greedy_tokens_match_tp1(ray_cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core runs in its own process and joins this module's cluster."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    path = str(tiny_model_dir("llama"))
    expected = greedy_tokens(path)
    assert len({tuple(t) for t in expected}) > 1
    assert greedy_tokens(path, tensor_parallel_size=2, distributed_executor_backend="ray") == expected
    assert_nothing_left()


def test_ray_pp2_greedy_tokens_match_pp1_with_two_micro_batches_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output is the last stage's (rank 1); ``execute_model`` returns before the
    step ran, so the batch queue holds two micro-batches (the spy counts them)."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spies live in this process
    path = str(tiny_model_dir("llama"))
    expected, _ = pipelined_greedy_tokens(path)
    assert len({tuple(t) for t in expected}) > 1
    # Whether a launched step was still running on the actors when the launch returned: a
    # launch that waited for the step would find every call finished.
    running: list[bool] = []
    submitted: list[list[object]] = []  # each call's object refs, as the actors were called
    launch, submit = RayDistributedExecutor.execute_model, RayDistributedExecutor._submit

    def spy_submit(self: RayDistributedExecutor, method: str, args: tuple) -> list[object]:
        refs = submit(self, method, args)
        submitted.append(refs)
        return refs

    def spy(self: RayDistributedExecutor, scheduler_output: object) -> object:
        pending = launch(self, scheduler_output)  # type: ignore[arg-type]
        refs = submitted[-1]  # the step's calls, submitted by this launch
        running.append(len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs))
        return pending

    monkeypatch.setattr(RayDistributedExecutor, "_submit", spy_submit)
    monkeypatch.setattr(RayDistributedExecutor, "execute_model", spy)
    tokens, depth = pipelined_greedy_tokens(path, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert tokens == expected
    assert depth == 2
    assert any(running)
    assert_nothing_left()


def test_killed_actor_of_the_last_stage_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is stage 1 (the output rank): its death is reported by Ray while stage 0
    has sent it a micro-batch."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              pipeline_parallel_size=2, distributed_executor_backend="ray")  # fmt: skip
    executor = llm.llm_engine.engine_core.core.executor
    assert isinstance(executor, RayDistributedExecutor)
    assert executor.output_rank == 1
    pids = executor.worker_pids
    try:
        first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
        assert len(first.outputs[0].token_ids) == GREEDY.max_tokens
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerRankError, match=r"rank 1 \(Ray actor, pid \d+ on .*\) died during execute_model") as info:
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert info.value.rank == 1
        assert time.monotonic() - start < 30
    finally:
        llm.llm_engine.shutdown()
    assert_nothing_left(pids)


def test_ray_structured_outputs_under_async_scheduling_match_sync(ray_cluster: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A step whose bitmask waits for the previous step's tokens: its forward and its
    sampling are two calls to every actor; the tokens are the synchronous engine's."""
    from kvloom.scheduler.scheduler import Scheduler
    from tests.structured_output.test_async_structured import _check_constrained, _generate, _llm

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    sync = _llm()
    expected = _generate(sync)
    sync.llm_engine.shutdown()
    _check_constrained(expected)
    rows: list[int] = []
    fill = Scheduler.get_grammar_bitmask

    def spy(self: Scheduler, so: object) -> object:
        grammar = fill(self, so)
        rows.append(0 if grammar is None else len(grammar.structured_output_request_ids))
        return grammar

    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", spy)
    llm = _llm(async_scheduling=True, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert _generate(llm) == expected
    finally:
        llm.llm_engine.shutdown()
    assert any(rows)
    assert_nothing_left()


def test_failed_or_killed_actor_raises_naming_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              tensor_parallel_size=2, distributed_executor_backend="ray")  # fmt: skip
    executor = llm.llm_engine.engine_core.core.executor
    assert isinstance(executor, RayDistributedExecutor)
    pids = executor.worker_pids
    assert len(running_pids(pids)) == 2 and os.getpid() not in pids
    # A rank that raises: its traceback, naming the rank; the executor still works after.
    with pytest.raises(WorkerRankError, match=r"(?s)rank [01] \(Ray actor, pid \d+ on .*\) raised in no_such_method"
                                              r".*AttributeError"):  # fmt: skip
        executor.collective_rpc("no_such_method")
    assert executor.collective_rpc("list_loras") == [set(), set()]
    # A rank whose process dies: Ray reports it, the step does not wait on rank 0 (which
    # is blocked in the all-reduce until the collective timeout).
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerRankError, match=r"rank 1 \(Ray actor, pid \d+ on .*\) died during execute_model") as info:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30
    llm.llm_engine.shutdown()
    assert_nothing_left(pids)


def test_the_flag_parses() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    namespace = parser.parse_args(["--model", "m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"])
    assert engine_args_from_namespace(namespace).distributed_executor_backend == "ray"
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2,
                                   distributed_executor_backend="ray")  # fmt: skip
    assert config.parallel.distributed_executor_backend == "ray"
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2,
                                   pipeline_parallel_size=2, distributed_executor_backend="ray")  # fmt: skip
    assert (config.parallel.distributed_executor_backend, config.parallel.world_size) == ("ray", 4)


def test_without_ray_installed_the_error_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=r"distributed_executor_backend: 'ray' needs Ray.*pip install ray"):
        resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2,
                              distributed_executor_backend="ray")  # fmt: skip


def test_platform_without_a_ray_resource_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloom_platform_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "ray_device_key", None)
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2,
                                   distributed_executor_backend="ray")  # fmt: skip
    with pytest.raises(ValueError, match=r"'ray' is not supported by the cpu platform .*ray_device_key"):
        RayDistributedExecutor(config)


@pytest.mark.parametrize(
    ("tp", "pp", "field"),
    [(4, 1, r"tensor_parallel_size"), (2, 2, r"tensor_parallel_size x pipeline_parallel_size \(2 x 2\)")],
)
def test_ranks_the_cluster_cannot_place_are_an_error_listing_its_resources(
    tp: int, pp: int, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four ranks on a cluster of two CPUs: a clear error after the placement timeout, and
    the pending placement group is removed."""
    monkeypatch.setenv("KVLOOM_RAY_PLACEMENT_TIMEOUT_S", "1")
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp, distributed_executor_backend="ray")  # fmt: skip
    with pytest.raises(RuntimeError, match=field + r": 4 ranks need 4 x \{'CPU': 1\} .* within 1 s "
                                           r"\(KVLOOM_RAY_PLACEMENT_TIMEOUT_S\); available now: .*'CPU': 2\.0"):  # fmt: skip
        RayDistributedExecutor(config)
    assert_nothing_left()
