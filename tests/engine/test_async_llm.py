"""AsyncLLM, the server's engine: one path from the engine to a caller.

Each ``generate()`` registers a ``RequestOutputCollector`` with the output processor; the
output handler fills it and the call awaits it. n > 1 fans out in the front end
(``ParentRequest``) and comes back merged under the caller's request id. The collector is
tested alone; the rest runs a tiny random model (the engine core in its own process).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvloom import LLM, SamplingParams
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.async_llm import AsyncLLM
from kvloom.engine.core_client import EngineDeadError
from kvloom.engine.output_processor import RequestOutputCollector
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.sampling_params import RequestOutputKind
from tests.helpers.engine_faults import STEP_FAILURE, StepFailsPlatform, with_platform
from tests.helpers.model_fixtures import random_prompts, tiny_async_llm, tiny_model_dir

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = random_prompts(320)[2]


def completion(index: int, text: str, token_ids: list[int], finish: str | None = None) -> CompletionOutput:
    logprobs = [{t: Logprob(-float(t))} for t in token_ids]
    return CompletionOutput(index, text, token_ids, cumulative_logprob=-1.0 * len(text), logprobs=logprobs,
                            finish_reason=finish)  # fmt: skip


def output(completions: list[CompletionOutput], finished: bool = False, prompt_logprobs: Any = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], prompt_logprobs, completions, finished)


# ----------------------------------------------------------------- the collector


def test_collector_merges_delta_outputs_that_piled_up() -> None:
    async def run() -> RequestOutput:
        collector = RequestOutputCollector(DELTA)
        first = output([completion(0, " a", [1]), completion(1, " x", [7])], prompt_logprobs=[None, {2: Logprob(-0.5)}])
        collector.put(first)
        collector.put(output([completion(1, " y", [8], finish="length")]))
        collector.put(output([completion(2, " p", [4]), completion(0, " b", [2], finish="stop")], finished=True))
        merged = await collector.get()
        # The outputs put first are not modified by the merge.
        assert [c.text for c in first.outputs] == [" a", " x"] and first.outputs[0].token_ids == [1]
        return merged

    merged = asyncio.run(run())
    assert merged.finished and merged.request_id == "r"
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, " a b", [1, 2], "stop"), (1, " x y", [7, 8], "length"), (2, " p", [4], None)]  # fmt: skip
    assert [list(step) for step in merged.outputs[0].logprobs] == [[1], [2]]
    assert merged.outputs[0].cumulative_logprob == -2.0  # the newer one
    assert merged.prompt_logprobs == [None, {2: Logprob(-0.5)}]


def test_collector_waits_replaces_other_kinds_and_raises_errors() -> None:
    async def run() -> None:
        collector = RequestOutputCollector(FINAL)
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing yet
        collector.put(output([completion(0, " a", [1])]))
        assert (await waiter).outputs[0].text == " a"
        # Not DELTA: the newer output carries everything and replaces the older.
        collector.put(output([completion(0, " a", [1])]))
        collector.put(output([completion(0, " a b", [1, 2])], finished=True))
        assert (await collector.get()).outputs[0].text == " a b"
        # An error wins over outputs, before or after it.
        collector.put(output([completion(0, " c", [3])]))
        collector.put(RuntimeError("engine died"))
        collector.put(output([completion(0, " d", [4])]))
        with pytest.raises(RuntimeError, match="engine died"):
            await collector.get()

    asyncio.run(run())


# ----------------------------------------------------------------- AsyncLLM on a tiny model


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_model_dir("llama"))


async def core_state(engine: AsyncLLM) -> tuple[int, float]:
    """(unfinished requests, KV-cache usage) of the core, read between its steps. Calls
    run in the order they were sent, so aborts sent before this one have been handled."""
    state = await engine.call_utility("core_state")
    return state["num_unfinished_requests"], state["kv_cache_usage"]


def test_n_comes_back_merged_and_seeded_like_offline(model_dir: str) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    offline = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB").generate(
        {"prompt_token_ids": PROMPT}, params, use_tqdm=False
    )[0]
    engine = tiny_async_llm(model_dir)

    async def run() -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        delta = params.model_copy(update={"output_kind": DELTA})
        async for out in engine.generate({"prompt_token_ids": PROMPT}, delta, "r"):
            assert out.request_id == "r"
            for c in out.outputs:
                tokens[c.index] += c.token_ids
        return tokens

    try:
        tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in offline.outputs]
    assert len({tuple(t) for t in tokens.values()}) > 1  # child i samples with seed + i


def test_closing_an_n_stream_aborts_every_child_and_frees_its_blocks(model_dir: str) -> None:
    engine = tiny_async_llm(model_dir)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=200, ignore_eos=True, output_kind=DELTA)

    async def run() -> tuple[set[int], tuple[int, float], tuple[int, float]]:
        seen: set[int] = set()
        stream = engine.generate({"prompt_token_ids": PROMPT}, params, "r")
        async for out in stream:
            seen |= {c.index for c in out.outputs}
            if seen == {0, 1, 2}:
                break
        running = await core_state(engine)
        await stream.aclose()  # the client went away
        return seen, running, await core_state(engine)

    try:
        seen, running, after = asyncio.run(run())
        op = engine.frontend.output_processor
        assert not op.request_states and not op.parent_requests
    finally:
        engine.shutdown()
    assert seen == {0, 1, 2}
    assert running[0] == 3 and running[1] > 0  # three children, holding blocks
    assert after == (0, 0.0)


def test_engine_death_wakes_every_waiting_request(model_dir: str) -> None:
    """A step fails (in the engine core process) with an error no single request caused:
    every open request, and every new one, gets it; health checks fail; the engine core
    process exits with status 1."""
    args = EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    engine = AsyncLLM(with_platform(create_engine_config(args), StepFailsPlatform))
    process = engine.engine_core.engine.process
    deaths: list[BaseException] = []
    engine.on_engine_dead(deaths.append)

    async def one(i: int, n: int) -> BaseException | None:
        params = SamplingParams(n=n, max_tokens=100, ignore_eos=True, output_kind=DELTA)
        try:
            async for _ in engine.generate({"prompt_token_ids": PROMPT}, params, f"r{i}"):
                pass
        except EngineDeadError as e:
            return e
        return None

    async def run() -> tuple[list[BaseException | None], BaseException | None, BaseException | None]:
        errors = await asyncio.wait_for(asyncio.gather(one(0, 1), one(1, 2)), timeout=60)
        try:
            await engine.check_health()
            health = None
        except EngineDeadError as e:
            health = e
        return errors, health, await one(2, 1)  # a new request fails at once

    try:
        errors, health, new = asyncio.run(run())
        process.join(timeout=15)
    finally:
        engine.shutdown()
    assert all(e is not None and STEP_FAILURE in str(e) for e in errors)
    assert engine.errored is not None and health is not None and isinstance(new, EngineDeadError)
    assert len(deaths) == 1 and STEP_FAILURE in str(deaths[0])
    assert process.exitcode == 1


def test_aborted_requests_count_as_finished_with_reason_abort(model_dir: str) -> None:
    """A client that goes away aborts its request: kvloom:request_success_total counts it
    under finished_reason="abort" (each sequence of an n > 1 request once)."""
    from prometheus_client import generate_latest

    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.metrics.loggers import PrometheusStatLogger

    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="32MiB"),
                                       stat_loggers=[PrometheusStatLogger])  # fmt: skip
    (prom,) = [s for s in engine.get_stat_loggers() if isinstance(s, PrometheusStatLogger)]

    def count(reason: str) -> float:
        text = generate_latest(prom.registry).decode()
        line = next(line for line in text.splitlines()
                    if line.startswith("kvloom:request_success_total") and f'finished_reason="{reason}"' in line)  # fmt: skip
        return float(line.rsplit(" ", 1)[1])

    async def run() -> None:
        for request_id, n in (("r1", 1), ("r2", 2)):
            params = SamplingParams(n=n, max_tokens=200, ignore_eos=True, output_kind=DELTA)
            stream = engine.generate({"prompt_token_ids": PROMPT}, params, request_id)
            await stream.__anext__()
            await stream.aclose()  # the client went away
        await core_state(engine)
        await asyncio.sleep(0.1)  # the core's own abort outputs arrive (and are not counted again)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert count("abort") == 3 and count("length") == 0
