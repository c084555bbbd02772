"""Async scheduling (``--async-scheduling``): step n+1 is scheduled and launched before
step n's tokens reach the host, and nothing a user sees changes.

On the CPU the device work is synchronous, so these tests check correctness, not overlap:
the same tokens, finish reasons, logprobs and seeded samples as the synchronous engine,
under chunked prefill, preemption, prefix caching, stops, penalties and aborts; that two
steps really are in flight; and the scheduler's placeholder bookkeeping on its own.
"""

from __future__ import annotations

import pytest
from tests.helpers.model_fixtures import hf_greedy_tokens, random_prompts, tiny_model_dir
from tests.helpers.fake_model import make_configs

from kvloom import LLM, SamplingParams
from kvloom.outputs import ModelRunnerOutput
from kvloom.request import Request, RequestStatus
from kvloom.scheduler.scheduler import Scheduler

PROMPTS = random_prompts(320)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _llm(arch: str = "llama", **kwargs) -> LLM:
    return LLM(str(tiny_model_dir(arch)), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True, **kwargs)


@pytest.fixture(scope="module")
def llama_hf() -> list[list[int]]:
    return hf_greedy_tokens(tiny_model_dir("llama"), PROMPTS, 24)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 8}, id="chunked-prefill"),
        pytest.param({"num_gpu_blocks_override": 10, "max_model_len": 96}, id="preemption"),
        pytest.param({"enable_prefix_caching": False, "block_size": 5}, id="odd-block-no-caching"),
    ],
)
def test_greedy_tokens_equal_hf(engine_kwargs, llama_hf):
    llm = _llm(async_scheduling=True, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [t for t, _ in _run(llm, params)] == llama_hf
    # Again, every prompt now a prefix-cache hit (when caching is on).
    assert [t for t, _ in _run(llm, params)] == llama_hf


def test_two_steps_are_in_flight_and_inputs_come_from_the_device(monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spies live in this process
    llm = _llm(async_scheduling=True)
    core = llm.llm_engine.engine_core.core
    runner = core.worker.runner
    depths, filled = [], []
    launch = core.worker.execute_model

    def spy_launch(so):
        pending = launch(so)
        depths.append(len(core._in_flight) + 1)
        return pending

    fill = runner.inputs._fill_placeholders

    def spy_fill(token_index, *args):
        filled.append(len(token_index))
        return fill(token_index, *args)

    monkeypatch.setattr(core.worker, "execute_model", spy_launch)
    monkeypatch.setattr(runner.inputs, "_fill_placeholders", spy_fill)
    _run(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert max(depths) == 2
    # Decode steps read every request's newest token from the device.
    assert max(filled) == len(PROMPTS)
    assert not core._in_flight and not core.has_work()


def test_stops_lengths_and_finish_reasons_match_sync():
    sync, asy = _llm(), _llm(async_scheduling=True)
    base = _run(sync, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # Stop on a token each sequence produces mid-way; different max_tokens per request.
    params = [
        SamplingParams(temperature=0, max_tokens=30 - 3 * i, ignore_eos=True, stop_token_ids=[tokens[10 + i]])
        for i, (tokens, _) in enumerate(base)
    ]
    expected = _run(sync, params)
    assert any(reason == "stop" for _, reason in expected)
    assert _run(asy, params) == expected
    # max_tokens=1 finishes after the prefill step; min_tokens holds back the stop token.
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert _run(asy, one) == _run(sync, one)
    held = [SamplingParams(temperature=0, max_tokens=20, min_tokens=15, ignore_eos=True, stop_token_ids=[t[2]])
            for t, _ in base]
    assert _run(asy, held) == _run(sync, held)


def test_penalties_seeds_and_logprobs_match_sync():
    sync, asy = _llm(), _llm(async_scheduling=True)
    penalised = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=0.5, presence_penalty=0.3)
    assert _run(asy, penalised) == _run(sync, penalised)
    # A batch mixing penalised and plain requests (the plain ones must not change either).
    mixed = [penalised if i % 2 else SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
             for i in range(len(PROMPTS))]
    assert _run(asy, mixed) == _run(sync, mixed)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    assert _run(asy, seeded) == _run(sync, seeded)
    with_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    a = sync.generate({"prompt_token_ids": PROMPTS[2]}, with_logprobs, use_tqdm=False)[0]
    b = asy.generate({"prompt_token_ids": PROMPTS[2]}, with_logprobs, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert x.keys() == y.keys()
        assert all(x[k].logprob == pytest.approx(y[k].logprob, abs=1e-5) for k in x)
    assert len(b.prompt_logprobs) == len(PROMPTS[2])


def test_abort_while_a_step_is_in_flight_keeps_the_others(llama_hf, monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # reads the core's state
    llm = _llm(async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        steps += 1
        if steps == 6:
            engine.abort_request(["1", "3"])
    assert set(results) == {"0", "2", "4"}  # aborted by the caller: no output, as in vLLM
    assert not llm.llm_engine.engine_core.core.has_work()
    assert [results[str(i)].token_ids for i in (0, 2, 4)] == [llama_hf[i] for i in (0, 2, 4)]
    # New requests after the abort reuse the freed rows and blocks correctly.
    assert [t for t, _ in _run(llm, params)] == llama_hf


def test_async_scheduling_flag_reaches_the_scheduler():
    import argparse

    from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace

    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_namespace(parser.parse_args(["--model", "m", "--async-scheduling"]))
    assert args.async_scheduling is True
    assert engine_args_from_namespace(parser.parse_args(["--model", "m"])).async_scheduling is False
    assert _llm(async_scheduling=True).config.scheduler.async_scheduling is True


# ----------------------------------------------------------------- the scheduler alone


def _scheduler(async_scheduling: bool = True) -> Scheduler:
    sc, cc = make_configs()
    return Scheduler(sc.model_copy(update={"async_scheduling": async_scheduling}), cc, num_blocks=32)


def _output(so, tokens: dict[str, int]) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in ids])


def test_scheduler_counts_placeholders_and_stops_at_max_tokens():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    so1 = s.schedule()  # prefill: samples output token 1
    a = s.requests["a"]
    assert so1.num_scheduled_tokens == {"a": 3} and a.num_output_placeholders == 1
    so2 = s.schedule()  # decode of the placeholder, before step 1's token is known
    assert so2.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    so3 = s.schedule()  # max_tokens=2 are both in flight: nothing more to run
    assert so3.num_scheduled_tokens == {}
    out1 = s.update_from_output(so1, _output(so1, {"a": 7}))
    assert out1.outputs[0].new_token_ids == [7] and a.num_output_placeholders == 1
    s.update_from_output(so3, _output(so3, {}))
    out2 = s.update_from_output(so2, _output(so2, {"a": 8}))
    assert out2.outputs[0].new_token_ids == [8]
    assert out2.outputs[0].finish_reason is not None and "a" not in s.requests


def test_scheduler_drops_tokens_of_a_request_that_stopped_while_in_flight():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[9])))
    so1, so2 = s.schedule(), s.schedule()
    out1 = s.update_from_output(so1, _output(so1, {"a": 9}))  # stops on token 9
    assert out1.outputs[0].finish_reason is not None
    out2 = s.update_from_output(so2, _output(so2, {"a": 5}))  # the step already in flight
    assert out2.outputs == [] and not s.has_unfinished_requests()


def test_scheduler_keeps_the_token_of_a_request_preempted_while_in_flight():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    so1 = s.schedule()
    a = s.requests["a"]
    s._preempt(a, 0.0)  # as schedule() does when the cache runs out
    so2 = s.schedule()  # not resumed before its in-flight token is back
    assert a.status == RequestStatus.PREEMPTED and "a" not in so2.num_scheduled_tokens
    out1 = s.update_from_output(so1, _output(so1, {"a": 4}))
    assert out1.outputs[0].new_token_ids == [4] and a.output_token_ids == [4] and a.num_output_placeholders == 0
    s.update_from_output(so2, _output(so2, {}))
    so3 = s.schedule()  # resumed: prompt and its token recomputed
    assert so3.scheduled_new_reqs[0].output_token_ids == [4]
    assert so3.num_scheduled_tokens["a"] + so3.scheduled_new_reqs[0].num_computed_tokens == 4


def test_penalised_requests_turn_scheduling_ahead_off():
    s = _scheduler()
    s.add_request(Request("a", [1, 2], SamplingParams(temperature=0, max_tokens=5)))
    s.schedule()
    assert s.can_schedule_ahead()
    s.add_request(Request("b", [1, 2], SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.2)))
    s.schedule()
    assert not s.can_schedule_ahead()
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.can_schedule_ahead()


def test_sync_engine_is_unchanged_by_the_flag_default():
    s = _scheduler(async_scheduling=False)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    s.schedule()
    assert s.requests["a"].num_output_placeholders == 0


def test_preemption_of_a_request_with_a_step_in_flight_keeps_its_token(llama_hf, monkeypatch):
    """10 blocks of 16 tokens for 5 requests: a request is preempted while its previous
    step is still in flight, and its token arrives after the preemption."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    llm = _llm(async_scheduling=True, num_gpu_blocks_override=10, max_model_len=96)
    scheduler = llm.llm_engine.engine_core.core.scheduler
    update, late = scheduler.update_from_output, []

    def spy(so, out):
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            request = scheduler.requests.get(req_id)
            if tokens and request is not None and request.status == RequestStatus.PREEMPTED:
                late.append(req_id)
        return update(so, out)

    monkeypatch.setattr(scheduler, "update_from_output", spy)
    assert [t for t, _ in _run(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))] == llama_hf
    assert late


def test_async_llm_streams_the_same_tokens_with_async_scheduling(llama_hf):
    """The server's engine (AsyncLLM, core loop in a thread) with async scheduling:
    concurrent streams, one cancelled half-way, the others complete with HF's tokens."""
    import asyncio

    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", async_scheduling=True,
        disable_log_stats=True,
    ))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def stream(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, params, request_id=f"s{i}"):
            tokens = out.outputs[0].token_ids
            if i == 1 and len(tokens) >= 5:
                break  # the client goes away: the request is aborted mid-flight
        return tokens

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(stream(i) for i in range(len(PROMPTS))))

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [results[i] for i in (0, 2, 3, 4)] == [llama_hf[i] for i in (0, 2, 3, 4)]
    assert results[1] == llama_hf[1][: len(results[1])]
