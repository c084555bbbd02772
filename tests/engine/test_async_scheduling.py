"""Async scheduling (``--async-scheduling``): step n+1 is scheduled and launched before
step n's tokens reach the host, and nothing a user sees changes.

On the CPU the device work is synchronous, so these tests check correctness, not overlap:
the same tokens, finish reasons, logprobs and seeded samples as the synchronous engine,
under chunked prefill, preemption, prefix caching, stops, every sampling feature (penalties
included, which count the token in flight on the device), LoRA, structured outputs,
pooling and aborts; that two steps really are in flight; how the default is resolved; and
the scheduler's placeholder bookkeeping on its own.
"""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams, StructuredOutputsParams
from kvloom.lora.request import LoRARequest
from kvloom.outputs import ModelRunnerOutput
from kvloom.request import Request, RequestStatus
from kvloom.scheduler.scheduler import Scheduler
from tests.helpers.fake_model import make_configs
from tests.helpers.lora_fixtures import make_adapter
from tests.helpers.model_fixtures import hf_greedy_tokens, random_prompts, tiny_model_dir

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
def test_greedy_tokens_equal_hf(engine_kwargs, llama_hf, monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # (the engine core process: test_async_llm_streams...)
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


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    base, root = tiny_model_dir("llama"), tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i + 1, str(make_adapter(base, root / name, seed=i + 1, r=8)))
            for i, name in enumerate(("a1", "a2"))}  # fmt: skip


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    """The synchronous and the async-scheduling engine (forced on: the CPU platform's
    default is off), LoRA on, in this process (the tests' spies reach the core)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
        kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
        return {False: _llm(async_scheduling=False, **kwargs), True: _llm(async_scheduling=True, **kwargs)}


def test_stops_lengths_and_finish_reasons_match_sync(engines):
    sync, asy = engines[False], engines[True]
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


def _every_feature(sync: LLM, adapters: dict[str, LoRARequest]) -> tuple[list, list[SamplingParams], list]:
    """One batch (prompts, params, LoRA requests) using every sampling feature at once;
    stop strings and stop tokens are cut from the synchronous engine's greedy text."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 3
    greedy = sync.generate(prompts[:5], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    text, tokens = greedy[0].outputs[0].text, greedy[1].outputs[0].token_ids
    penalties = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.4}
    seeded = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02}
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties),
        SamplingParams(seed=3, max_tokens=24, ignore_eos=True, **seeded, **penalties),
        SamplingParams(seed=4, max_tokens=24, ignore_eos=True, **seeded),
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=16, ignore_eos=True, frequency_penalty=0.8),
        SamplingParams(temperature=0, max_tokens=24, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=12, stop_token_ids=[tokens[2]]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={tokens[3]: 4.0}),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.0),  # + LoRA a1
        SamplingParams(seed=6, max_tokens=24, ignore_eos=True, **seeded, repetition_penalty=1.3),  # + LoRA a2
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,9}\."),
                       frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=24),  # EOS may end it
    ]
    loras = [None] * 8 + [adapters["a1"], adapters["a2"], None, None]
    return prompts[: len(params)], params, loras


def _outputs(llm: LLM, prompts: list, params: list[SamplingParams], loras: list) -> list:
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    result = []
    for out in outs:
        for c in out.outputs:
            logprobs = [{t: round(lp.logprob, 4) for t, lp in step.items()} for step in c.logprobs or []]
            result.append((list(c.token_ids), c.text, c.finish_reason, logprobs))
        prompt_lps = [{t: round(lp.logprob, 4) for t, lp in step.items()} if step else None
                      for step in out.prompt_logprobs or []]  # fmt: skip
        result.append(prompt_lps)
    return result


def test_every_sampling_feature_overlaps_and_samples_as_sync(engines, adapters, monkeypatch):
    """Penalties, seeded top-k/top-p/min-p, logprobs and prompt logprobs, n > 1, stop
    strings and tokens, min_tokens, logit_bias, LoRA and structured outputs in one batch:
    the async-scheduling engine gives the synchronous engine's tokens, texts, finish
    reasons and logprobs, keeping two steps in flight all along; penalties count the
    tokens still in flight on the device."""
    sync, asy = engines[False], engines[True]
    prompts, params, loras = _every_feature(sync, adapters)
    expected = _outputs(sync, prompts, params, loras)
    assert {o[2] for o in expected if isinstance(o, tuple)} >= {"stop", "length"}

    core = asy.llm_engine.engine_core.core
    inputs = core.worker.runner.inputs
    depths, counted = [], []
    launch, in_flight = core.worker.execute_model, inputs.in_flight_tokens

    def spy_launch(so):
        pending = launch(so)
        depths.append(len(core._in_flight) + 1)
        return pending

    def spy_in_flight(states):
        held = in_flight(states)
        counted.append(0 if held is None else len(held[0]))
        return held

    monkeypatch.setattr(core.worker, "execute_model", spy_launch)
    monkeypatch.setattr(inputs, "in_flight_tokens", spy_in_flight)
    assert _outputs(asy, prompts, params, loras) == expected
    # Two steps in flight for most of the run (no synchronous fallback for penalties), and
    # the penalised rows' tokens in flight were counted on the device.
    assert depths.count(2) >= len(depths) - 4
    assert max(counted) >= 5


def test_pooling_and_chunked_prefill_under_async_scheduling(monkeypatch):
    """A pooling model (no sampled tokens, results once its prompt is done) beside itself
    with async scheduling, prompts chunked across steps: the same embeddings."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    kwargs = {"runner": "pooling", "pooling_type": "MEAN", "max_num_batched_tokens": 16, "max_num_seqs": 4}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sync = [o.outputs.embedding for o in _llm(**kwargs).embed(prompts, use_tqdm=False)]
    asy = [o.outputs.embedding for o in _llm(async_scheduling=True, **kwargs).embed(prompts, use_tqdm=False)]
    for a, b in zip(asy, sync):
        assert a == pytest.approx(b, abs=1e-5)


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


def test_async_scheduling_is_resolved_per_platform_and_parallelism(monkeypatch, caplog):
    """``--async-scheduling`` / ``--no-async-scheduling`` as given; unset, on where the
    platform's device runs asynchronously (CUDA), off on the CPU and with pipeline stages;
    the outcome and why are logged."""
    import argparse
    import logging

    from kvloom.engine.config_builder import resolve_async_scheduling
    from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
    from kvloom.platforms.interface import Platform

    parser = add_engine_args(argparse.ArgumentParser())

    def parsed(*flags: str) -> bool | None:
        return engine_args_from_namespace(parser.parse_args(["--model", "m", *flags])).async_scheduling

    assert (parsed("--async-scheduling"), parsed("--no-async-scheduling"), parsed()) == (True, False, None)
    gpu = type("Gpu", (), {"name": "gpu", "supports_async_scheduling": True})
    cpu = type("Cpu", (), {"name": "cpu", "supports_async_scheduling": False})
    assert Platform.supports_async_scheduling is False  # an out-of-tree platform opts in
    with caplog.at_level(logging.INFO, logger="kvloom.engine.config_builder"):
        assert resolve_async_scheduling(None, gpu, 1) is True
        assert "Async scheduling on (default: platform gpu runs the device asynchronously" in caplog.text
        assert resolve_async_scheduling(None, gpu, 2) is False  # pipeline stages keep their micro-batches
        assert "pipeline parallelism keeps 2 micro-batches in flight" in caplog.text
        assert resolve_async_scheduling(None, cpu, 1) is False
        assert resolve_async_scheduling(False, gpu, 1) is False
        assert resolve_async_scheduling(True, cpu, 1) is True  # forced: correct, nothing to overlap
        assert resolve_async_scheduling(None, gpu, 1, speculative=True) is False  # drafts follow accepted tokens
        assert resolve_async_scheduling(True, gpu, 1, speculative=True) is False
        assert "nothing to overlap" in caplog.text
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    assert _llm().config.scheduler.async_scheduling is False  # the CPU platform's default
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
