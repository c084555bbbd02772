"""One request cannot take the engine down: what fails for one request fails that request.

A request the engine core cannot serve (its token ids, its sampling parameters, its
pooling) is refused when it arrives, before it joins a batch (``FinishReason.ABORT`` with
an ``error``). Work of one request that fails inside a step (its row of the sampling
state, its prompt logprobs, its pooling) fails that request (``FinishReason.ERROR``) and
the rest of the batch completes with exactly the tokens it has without it. The tiny random
Llama runs the real engine core; failures injected into the engine core with monkeypatch
need it in this process (KVLOOM_ENABLE_MULTIPROCESSING=0); the front-end failure runs
across the process boundary.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from unittest import mock

import pytest

from kvloom import LLM, SamplingParams
from kvloom.engine.errors import RequestFailedError
from kvloom.outputs import EngineCoreOutput
from kvloom.request import EngineCoreRequest, FinishReason
from kvloom.sampling_params import PoolingParams
from kvloom.worker import step_output, step_sampler
from tests.helpers.model_fixtures import random_prompts, tiny_async_llm, tiny_model_dir

VOCAB = 512  # the tiny Llama's
PROMPTS = random_prompts(320)
MAX_TOKENS = 8


def _core(**kwargs: Any) -> Any:
    """The EngineCore of an offline engine, in this process (to step it by hand)."""
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB",
                  disable_log_stats=True, **kwargs)  # fmt: skip
    return llm.llm_engine.engine_core.core


def _greedy(**overrides: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **overrides)


def _run(core: Any, requests: list[EngineCoreRequest]) -> dict[str, tuple[list[int], EngineCoreOutput]]:
    """Add ``requests`` at once and step until every one finished: id -> (tokens, final output)."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, EngineCoreOutput] = {}
    for _ in range(200):
        if not core.has_work():
            break
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    assert set(final) == set(tokens), f"unfinished: {set(tokens) - set(final)}"
    assert not core.has_work() and core.scheduler.kv_cache_manager.usage == 0
    return {rid: (tokens[rid], final[rid]) for rid in tokens}


def _request(request_id: str, prompt: list[int], params: SamplingParams | None = None,
             pooling: PoolingParams | None = None) -> EngineCoreRequest:  # fmt: skip
    return EngineCoreRequest(request_id, prompt, params, pooling_params=pooling)


def _good_requests() -> list[EngineCoreRequest]:
    return [_request(f"good-{i}", p, _greedy()) for i, p in enumerate(PROMPTS[:3])]


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    """The good requests' tokens when they run alone."""
    return {rid: toks for rid, (toks, _) in _run(_core(), _good_requests()).items()}


def _assert_good_requests_unharmed(results: dict, baseline: dict[str, list[int]]) -> None:
    for rid, expected in baseline.items():
        tokens, final = results[rid]
        assert tokens == expected and final.finish_reason == FinishReason.LENGTH and final.error is None


# ----------------------------------------------------------------- refused when it arrives


def test_unusable_requests_are_refused_alone_and_the_batch_goes_on(baseline: dict) -> None:
    """The hostile top_k of the issue (it overflowed the sampler's tensor inside a step and
    killed the engine), a token id outside the vocabulary (an index error in the
    embedding), a logprobs count beyond the vocabulary, a logit_bias id outside it (an
    index error in the sampler, a device-side assert on a GPU) and prompts the context
    cannot hold are refused at admission (the rules of ``kvloom.model_limits``, which the
    core applies although the front end did: it trusts no client)."""
    core = _core()
    max_len = core.limits.max_model_len
    bad_top_k = SamplingParams.model_construct(**{**_greedy().model_dump(), "temperature": 0.8,
                                                  "top_k": 1180591620717411303424})  # fmt: skip
    bad_logprobs = SamplingParams.model_construct(**{**_greedy().model_dump(), "logprobs": VOCAB + 1})
    bad = [
        _request("bad-top-k", PROMPTS[3], bad_top_k),
        _request("bad-token", [5, VOCAB, 7], _greedy()),
        _request("negative-token", [5, -1], _greedy()),
        _request("bad-logprobs", PROMPTS[4], bad_logprobs),
        _request("bad-bias", PROMPTS[3], _greedy(logit_bias={VOCAB: 1.0})),
        _request("too-long", [5] * max_len, _greedy()),
        _request("empty", [], _greedy()),
    ]
    results = _run(core, [*_good_requests()[:2], *bad, _good_requests()[2]])
    _assert_good_requests_unharmed(results, baseline)
    expected = {"bad-top-k": f"top_k: 1180591620717411303424 is out of range (allowed: -1 or 0 to disable top-k, "
                             f"else 1 <= top_k <= {VOCAB}, the vocabulary size)",
                "bad-token": f"prompt_token_ids: token id {VOCAB} is out of range (allowed: 0..{VOCAB - 1})",
                "negative-token": "prompt_token_ids: token id -1 is out of range",
                "bad-logprobs": f"logprobs: {VOCAB + 1} is more than this engine allows (allowed range: 0 <= logprobs "
                                "<= 20, max_logprobs, --max-logprobs)",
                "bad-bias": f"logit_bias: token id {VOCAB} is out of range (allowed: 0..{VOCAB - 1})",
                "too-long": f"prompt: the prompt is {max_len} tokens, but this model's maximum context length is "
                            f"{max_len} tokens (allowed: at most {max_len - 1} prompt tokens",
                "empty": "prompt: the prompt is empty"}  # fmt: skip
    for rid, fragment in expected.items():
        tokens, final = results[rid]
        assert tokens == [] and final.finish_reason == FinishReason.ABORT
        assert fragment in final.error, final.error
    # The engine serves on.
    _assert_good_requests_unharmed(_run(core, _good_requests()), baseline)


def test_pooling_dimensions_larger_than_the_model_are_refused() -> None:
    core = _core(runner="pooling")
    results = _run(core, [_request("ok", PROMPTS[0], pooling=PoolingParams(dimensions=8)),
                          _request("too-wide", PROMPTS[1], pooling=PoolingParams(dimensions=65))])  # fmt: skip
    assert results["ok"][1].finish_reason == FinishReason.STOP and results["ok"][1].pooling_output.shape == (8,)
    _, final = results["too-wide"]
    assert final.finish_reason == FinishReason.ABORT and "dimensions: 65 is larger than the model's 64" in final.error


# ----------------------------------------------------------------- failing inside a step

BAD_SEED = 4242


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_a_sampling_failure_mid_batch_fails_that_request_alone(
    monkeypatch: pytest.MonkeyPatch, baseline: dict, async_scheduling: bool
) -> None:
    """The batch's sampling state fails whenever the request seeded BAD_SEED is in it with
    two tokens out: it fails after them, the in-flight others complete as without it."""
    build = step_sampler.SamplingMetadata.build

    def failing_build(*, params, output_token_ids, **kwargs):
        if any(p.seed == BAD_SEED and len(out) >= 2 for p, out in zip(params, output_token_ids)):
            raise RuntimeError("injected sampling failure")
        return build(params=params, output_token_ids=output_token_ids, **kwargs)

    monkeypatch.setattr(step_sampler.SamplingMetadata, "build", staticmethod(failing_build))
    # The failure follows the tokens out, so the runner must build the state every step
    # instead of reusing the previous step's.
    monkeypatch.setattr(step_sampler.SamplingMetadata, "reusable", property(lambda self: False))
    core = _core(async_scheduling=async_scheduling)
    good = _good_requests()
    results = _run(core, [good[0], _request("bad", PROMPTS[4], _greedy(seed=BAD_SEED)), *good[1:]])
    _assert_good_requests_unharmed(results, baseline)
    tokens, final = results["bad"]
    # With async scheduling the runner counts the token still in flight as out.
    assert len(tokens) == (1 if async_scheduling else 2) and final.finish_reason == FinishReason.ERROR
    assert "sampling failed (RuntimeError: injected sampling failure)" in final.error
    # The engine serves on, the failed request left nothing behind in the runner.
    _assert_good_requests_unharmed(_run(core, _good_requests()), baseline)
    assert not core.worker.runner.failures and not core.worker.runner.input_batch.requests


def test_a_prompt_logprobs_failure_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch, baseline: dict) -> None:
    def failing(*args: Any) -> Any:
        raise FloatingPointError("injected prompt logprobs failure")

    monkeypatch.setattr(step_output, "compute_prompt_logprobs", failing)
    core = _core()
    results = _run(core, [*_good_requests(), _request("bad", PROMPTS[4], _greedy(prompt_logprobs=2))])
    _assert_good_requests_unharmed(results, baseline)
    tokens, final = results["bad"]
    assert tokens == [] and final.finish_reason == FinishReason.ERROR
    assert "computing its prompt logprobs failed (FloatingPointError: injected" in final.error


def test_a_pooling_failure_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = step_output.pool_request

    def failing(config, state, chunk, prompt_done, head=None):
        if state.req_id == "bad":
            raise ValueError("injected pooling failure")
        return pool(config, state, chunk, prompt_done, head)

    monkeypatch.setattr(step_output, "pool_request", failing)
    core = _core(runner="pooling")
    results = _run(core, [_request(rid, p, pooling=PoolingParams()) for rid, p in zip(["a", "bad", "b"], PROMPTS)])
    assert results["a"][1].pooling_output is not None and results["b"][1].pooling_output is not None
    assert results["bad"][1].finish_reason == FinishReason.ERROR and "pooling failed" in results["bad"][1].error


# ----------------------------------------------------------------- through AsyncLLM


async def _collect(engine: Any, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    """The token ids of the request's final output (its error raised, if it failed)."""
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        final = out
    return final.outputs[0].token_ids


def test_async_llm_raises_the_failure_for_its_request_and_serves_on(monkeypatch: pytest.MonkeyPatch,
                                                                   baseline: dict) -> None:  # fmt: skip
    build = step_sampler.SamplingMetadata.build

    def failing_build(*, params, output_token_ids, **kwargs):
        if any(p.seed is not None and len(out) >= 1 for p, out in zip(params, output_token_ids)):
            raise RuntimeError("injected sampling failure")  # after the first token of a seeded request
        return build(params=params, output_token_ids=output_token_ids, **kwargs)

    monkeypatch.setattr(step_sampler.SamplingMetadata, "build", staticmethod(failing_build))
    monkeypatch.setattr(step_sampler.SamplingMetadata, "reusable", property(lambda self: False))  # build every step
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched runner lives in this process
    engine = tiny_async_llm(tiny_model_dir("llama"))

    async def run() -> list[Any]:
        jobs = [_collect(engine, p, _greedy(), f"good-{i}") for i, p in enumerate(PROMPTS[:3])]
        jobs.insert(1, _collect(engine, PROMPTS[4], _greedy(seed=BAD_SEED, n=2), "bad"))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        await engine.check_health()  # the engine is alive
        again = await _collect(engine, PROMPTS[0], _greedy(), "again")
        return [*results, again]

    try:
        good0, bad, good1, good2, again = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(bad, RequestFailedError) and "sampling failed" in str(bad)
    assert [good0, good1, good2] == list(baseline.values()) and again == baseline["good-0"]
    assert not engine.frontend.output_processor.request_states and not engine.frontend.output_processor.parent_requests


def test_a_front_end_failure_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch, baseline: dict) -> None:
    """Processing one request's output in the front end fails (its logprobs): that request
    fails and is aborted in the core, the others complete, the engine serves on."""
    from kvloom.engine import output_processor

    def failing(self: Any, logprobs: Any) -> None:
        raise KeyError("injected front-end failure")

    monkeypatch.setattr(output_processor.LogprobsAccumulator, "add_sample_logprobs", failing)
    engine = tiny_async_llm(tiny_model_dir("llama"))

    async def run() -> list[Any]:
        jobs = [_collect(engine, p, _greedy(), f"good-{i}") for i, p in enumerate(PROMPTS[:3])]
        logprobs = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=2)
        jobs.append(_collect(engine, PROMPTS[4], logprobs, "bad"))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for _ in range(100):  # the core's abort of "bad" arrives with a later step
            if not (await engine.call_utility("core_state"))["has_work"]:
                break
            await asyncio.sleep(0.02)
        usage = (await engine.call_utility("core_state"))["kv_cache_usage"]
        return [*results, usage]

    try:
        *good, bad, usage = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(bad, RequestFailedError) and "processing its output failed (KeyError" in str(bad)
    assert good == list(baseline.values()) and usage == 0
