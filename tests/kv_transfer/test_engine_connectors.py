"""A KV connector in the engine (the tiny random Llama, in-process engine cores stepped by
hand, the in-memory ``MemoryConnector`` of ``tests.kv_transfer.memory_connector``).

Two engines share its store: the second gives exactly the first one's greedy tokens and
computes only what the first did not store (counted), whether the KV arrives in the step
or asynchronously. What the connector fails at fails that request alone: a method that
raises, a load that reports its blocks failed (``kv_load_failure_policy`` fail: the
request fails; recompute: its KV is computed and its tokens are the same); the other
requests of the batch get exactly their tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

from kvloom import LLM, SamplingParams
from kvloom.request import EngineCoreRequest, FinishReason, RequestStatus
from tests.helpers.model_fixtures import random_prompts, tiny_model_dir
from tests.kv_transfer.memory_connector import STORE, transfer_config

VOCAB = 512  # the tiny Llama's
BLOCK = 16
PROMPTS = random_prompts(VOCAB, lengths=(37, 50, 64, 21), seed=41)


def _core(**kwargs: Any) -> Any:
    """The EngineCore of an offline engine, in this process (to step it by hand)."""
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                  disable_log_stats=False, log_stats_interval=1000, **kwargs)  # fmt: skip
    return llm.llm_engine.engine_core.core


def _greedy(params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, kv_transfer_params=params)


def _run(core: Any, requests: list[EngineCoreRequest]) -> tuple[dict[str, Any], int]:
    """Add ``requests`` at once, step until all finished: (id -> (tokens, final output),
    tokens the engine computed)."""
    scheduled = 0
    schedule = core.scheduler.schedule

    def counting() -> Any:
        nonlocal scheduled
        output = schedule()
        scheduled += output.total_num_scheduled_tokens
        return output

    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, Any] = {}
    with mock.patch.object(core.scheduler, "schedule", counting):
        for _ in range(300):
            if not core.has_work():
                break
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    final[out.request_id] = out
    assert set(final) == set(tokens), f"unfinished: {set(tokens) - set(final)}"
    assert not core.has_work() and core.scheduler.kv_cache_manager.usage == 0
    return {rid: (tokens[rid], final[rid]) for rid in tokens}, scheduled


def _requests(prefix: str, params: dict[int, dict[str, Any]] | None = None) -> list[EngineCoreRequest]:
    params = params or {}
    return [EngineCoreRequest(f"{prefix}-{i}", p, _greedy(params.get(i))) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    results, _ = _run(_core(), _requests("r"))
    return {rid: toks for rid, (toks, _) in results.items()}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """A producer and a consumer engine sharing the store (loads synchronous or asynchronous)."""
    STORE.clear()
    yield _core(kv_transfer_config=transfer_config(role="kv_producer")), \
        _core(kv_transfer_config=transfer_config(role="kv_consumer", load_async=request.param))
    STORE.clear()


def test_a_consumer_gives_the_same_tokens_and_computes_only_the_tail(shared: Any, baseline: dict) -> None:
    producer, consumer = shared
    produced, computed = _run(producer, _requests("r"))
    assert {rid: toks for rid, (toks, _) in produced.items()} == baseline
    stored = {rid: (len(p) - 1) // BLOCK * BLOCK for rid, p in zip(baseline, PROMPTS)}
    assert computed == sum(len(p) for p in PROMPTS) + 5 * len(PROMPTS)  # prompts, then 5 decode steps each
    consumed, computed = _run(consumer, _requests("r"))
    assert {rid: toks for rid, (toks, _) in consumed.items()} == baseline
    assert {rid: out.num_cached_tokens for rid, (_, out) in consumed.items()} == stored
    assert computed == sum(len(p) for p in PROMPTS) - sum(stored.values()) + 5 * len(PROMPTS)
    stats = consumer.scheduler.make_stats().kv_transfer_stats
    assert stats is not None  # counted since the last stats: the consumer's lookups
    assert stats.hits == 0 or stats.hits == sum(stored.values())


@pytest.mark.parametrize("method", ["get_num_new_matched_tokens", "update_state_after_alloc", "start_load_kv",
                                    "load_blocks"])  # fmt: skip
def test_a_failing_connector_fails_its_request_alone(method: str, baseline: dict) -> None:
    """A scheduler-side method that raises fails the request it was called for; the worker
    side's ``start_load_kv`` serves the whole step, so it fails the requests that load in
    the step: only the failing one has stored KV here, the others compute theirs."""
    STORE.clear()
    _run(_core(kv_transfer_config=transfer_config(role="kv_producer")), _requests("r")[1:2])
    core = _core(kv_transfer_config=transfer_config())
    results, _ = _run(core, _requests("r", {1: {"fail_in": method}}))
    tokens, out = results["r-1"]
    assert out.finish_reason == FinishReason.ERROR and tokens == []
    assert "MemoryConnector" in (out.error or "") and (method in out.error or "failed to load" in out.error
                                                       or "reported blocks" in out.error), out.error  # fmt: skip
    assert {rid: toks for rid, (toks, _) in results.items() if rid != "r-1"} == {
        rid: toks for rid, toks in baseline.items() if rid != "r-1"
    }
    STORE.clear()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_an_asynchronous_load_that_fails_follows_the_policy(policy: str, baseline: dict) -> None:
    STORE.clear()
    _run(_core(kv_transfer_config=transfer_config(role="kv_producer")), _requests("r"))
    config = {**transfer_config(load_async=True), "kv_load_failure_policy": policy}
    results, _ = _run(_core(kv_transfer_config=config), _requests("r", {2: {"fail_in": "load_blocks"}}))
    tokens, out = results["r-2"]
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR and "failed to load" in (out.error or "")
    else:
        assert tokens == baseline["r-2"] and out.error is None and out.num_cached_tokens == 0
    assert {rid: toks for rid, (toks, _) in results.items() if rid != "r-2"} == {
        rid: toks for rid, toks in baseline.items() if rid != "r-2"
    }
    STORE.clear()


def test_a_request_aborted_while_its_kv_arrives_frees_its_blocks() -> None:
    STORE.clear()
    _run(_core(kv_transfer_config=transfer_config(role="kv_producer")), _requests("r"))
    core = _core(kv_transfer_config=transfer_config(load_async=True))
    core.add_request(EngineCoreRequest("waiting", PROMPTS[2], _greedy()))
    core.step()  # admitted: its load starts (and, in memory, ends) in this step
    request = core.scheduler.requests["waiting"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and core.scheduler.kv_cache_manager.usage > 0
    core.abort_requests(["waiting"])
    for _ in range(5):
        core.step()
    assert not core.has_work() and core.scheduler.kv_cache_manager.usage == 0
    STORE.clear()


def test_kv_transfer_params_reach_the_connector_and_come_back() -> None:
    plain = _core()
    results, _ = _run(plain, [EngineCoreRequest("p", PROMPTS[0], _greedy({"do_remote_decode": True}))])
    out = results["p"][1]
    assert out.finish_reason == FinishReason.ABORT and "runs no KV connector" in (out.error or "")
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                  kv_transfer_config=transfer_config())  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                           [_greedy({"do_remote_decode": True}), _greedy()])  # fmt: skip
    assert [o.kv_transfer_params for o in outputs] == [{"saved_by": "memory"}, None]
    STORE.clear()
