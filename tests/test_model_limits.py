"""The model-bounded rules (``kvloom.model_limits``): each written once, and applied on the
three paths a request can take: the OpenAI server (a 400 naming the field), the front
end (``ValueError``, under ``LLM``) and the engine core (the request refused alone).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from fastapi.testclient import TestClient
from tests.helpers.serve_fakes import FakeAsyncLLM, make_config

from kvloom import LLM, SamplingParams
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.model_limits import (
    SAMPLING_RULES,
    ModelLimits,
    check_against_model,
    out_of_vocab,
)
from kvloom.request import EngineCoreRequest, FinishReason
from kvloom.sampling_params import PoolingParams
from kvloom.testing.models import tiny_model_dir

LIMITS = ModelLimits(vocab_size=100, max_model_len=32, max_logprobs=5, hidden_size=16)


def problems(params: SamplingParams | PoolingParams, prompt_ids: list[int] | None = None, **names: str) -> list:
    return check_against_model(params, [1, 2] if prompt_ids is None else prompt_ids, LIMITS, names)


# ----------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    "params,field,message",
    [
        (SamplingParams(top_k=101), "top_k",
         "top_k: 101 is out of range (allowed: -1 or 0 to disable top-k, else 1 <= top_k <= 100, the vocabulary size)"),
        (SamplingParams(logprobs=6), "logprobs",
         "logprobs: 6 is more than this engine allows (allowed range: 0 <= logprobs <= 5, max_logprobs, --max-logprobs)"),
        (SamplingParams(prompt_logprobs=6), "prompt_logprobs", "prompt_logprobs: 6 is more than this engine allows"),
        (SamplingParams(stop_token_ids=[3, 100]), "stop_token_ids",
         "stop_token_ids: token id 100 is out of range (allowed: 0..99)"),
        (SamplingParams(logit_bias={7: 1.0, 250: 1.0}), "logit_bias", "logit_bias: token id 250 is out of range (allowed: 0..99)"),
        (PoolingParams(dimensions=17), "dimensions",
         "dimensions: 17 is larger than the model's 16 (allowed range: 1 <= dimensions <= 16)"),
    ],
)  # fmt: skip
def test_each_rule_names_the_field_its_value_and_the_allowed_range(params, field: str, message: str) -> None:
    (problem,) = problems(params)
    assert problem[0] == field and problem[1].startswith(message), problem


def test_the_limits_are_inclusive() -> None:
    assert problems(SamplingParams(top_k=100, logprobs=5, prompt_logprobs=5, stop_token_ids=[0, 99],
                                   logit_bias={99: -1.0})) == []  # fmt: skip
    assert problems(PoolingParams(dimensions=16)) == []
    assert problems(SamplingParams(), list(range(31))) == []  # room for one output token
    assert problems(PoolingParams(), list(range(32))) == []  # pooling generates nothing


def test_logprobs_beyond_a_small_vocabulary() -> None:
    small = ModelLimits(vocab_size=4, max_model_len=32, max_logprobs=20, hidden_size=16)
    ((field, message),) = check_against_model(SamplingParams(logprobs=5), [1], small)
    assert field == "logprobs" and message == "logprobs: 5 is larger than the vocabulary (allowed range: 0 <= logprobs <= 4)"


def test_prompt_rules() -> None:
    assert problems(SamplingParams(), []) == [("prompt", "prompt: the prompt is empty (it has no tokens)")]
    assert problems(SamplingParams(), [5, -1, 100]) == [
        ("prompt_token_ids", "prompt_token_ids: token id -1 is out of range (allowed: 0..99)")]  # fmt: skip
    ((field, message),) = problems(SamplingParams(), [1] * 32)
    assert field == "prompt" and message == ("prompt: the prompt is 32 tokens, but this model's maximum context length "
                                             "is 32 tokens (allowed: at most 31 prompt tokens, leaving room for one "
                                             "output token)")  # fmt: skip
    ((_, message),) = problems(PoolingParams(), [1] * 33)
    assert message.endswith("(allowed: at most 32 prompt tokens)")


def test_every_problem_is_listed_in_the_callers_names() -> None:
    """``names``: the caller's names of the fields (the chat API's ``top_logprobs``, the
    server's ``messages``), in the field and in the message."""
    found = problems(SamplingParams(logprobs=9, top_k=500), [1] * 40, logprobs="top_logprobs", prompt="messages")
    assert [field for field, _ in found] == ["messages", "top_logprobs", "top_k"]
    assert found[1][1].startswith("top_logprobs: 9 is more than this engine allows (allowed range: 0 <= top_logprobs")


def test_out_of_vocab_names_the_first_bad_id() -> None:
    assert out_of_vocab([], 10) is None and out_of_vocab([0, 9], 10) is None
    assert out_of_vocab([3, 12, -4], 10) == "token id 12 is out of range (allowed: 0..9)"


# ----------------------------------------------------------------- one rule, three paths


def _min_tokens_cap(name: str, value: int, limits: ModelLimits) -> str | None:
    """A rule this test adds for a field no model-bounded rule covers."""
    cap = limits.max_model_len // 16
    return None if value <= cap else f"{value} is more than this test allows (allowed: {name} <= {cap})"


@pytest.fixture
def min_tokens_rule(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The rule, registered in the one place a rule goes."""
    monkeypatch.setitem(SAMPLING_RULES, "min_tokens", _min_tokens_cap)
    yield


def test_a_rule_added_once_is_checked_by_the_server_the_front_end_and_the_engine_core(min_tokens_rule: None) -> None:
    """The server checks before the engine sees the request (the fake engine checks
    nothing; ``param`` names the field, which the front end's ``ValueError`` would not);
    the front end refuses it under ``LLM``; the engine core refuses one sent to it
    directly (another front end may have skipped the check)."""
    # The server: a 400 naming the field; the cap's value is accepted.
    engine = FakeAsyncLLM(make_config(max_model_len=64))  # a cap of 4
    client = TestClient(build_app(engine, log_stats=False))
    body = {"prompt": "w5 w6", "max_tokens": 8, "min_tokens": 5}
    error = client.post("/v1/completions", json=body).json()["error"]
    assert (error["param"], error["message"]) == ("min_tokens", "min_tokens: 5 is more than this test allows "
                                                                "(allowed: min_tokens <= 4)")  # fmt: skip
    assert not engine.requests
    assert client.post("/v1/completions", json={**body, "min_tokens": 4}).status_code == 200

    # The front end (LLM), and the engine core of the same engine (in this process).
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", max_model_len=64,
                  disable_log_stats=True)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, ignore_eos=True)
        with pytest.raises(ValueError, match=r"^min_tokens: 5 is more than this test allows \(allowed: min_tokens <= 4\)$"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        (good,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params.model_copy(update={"min_tokens": 4}),
                               use_tqdm=False)  # fmt: skip
        assert len(good.outputs[0].token_ids) == 8

        core = llm.llm_engine.engine_core.core
        finals = _run_core(core, [EngineCoreRequest("bad", [5, 6, 7], params),
                                  EngineCoreRequest("good", [5, 6, 7], params.model_copy(update={"min_tokens": 4}))])
        assert finals["bad"].finish_reason == FinishReason.ABORT
        assert finals["bad"].error == "min_tokens: 5 is more than this test allows (allowed: min_tokens <= 4)"
        assert finals["good"].finish_reason == FinishReason.LENGTH and finals["good"].error is None
    finally:
        llm.llm_engine.shutdown()


def _run_core(core: Any, requests: list[EngineCoreRequest]) -> dict[str, Any]:
    """Add ``requests`` to the engine core directly and step it until each has its final output."""
    for request in requests:
        core.add_request(request)
    finals: dict[str, Any] = {}
    for _ in range(100):
        if len(finals) == len(requests):
            break
        finals.update({out.request_id: out for out in core.step().outputs if out.finished})
    return finals


def test_the_chat_api_names_top_logprobs() -> None:
    """Chat's ``top_logprobs`` is ``SamplingParams.logprobs``: the server's 400 names the
    request's field."""
    config = make_config()
    config.model.max_logprobs = 2
    client = TestClient(build_app(FakeAsyncLLM(config), log_stats=False))
    body = {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 3}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "top_logprobs"
    assert error["message"].startswith("top_logprobs: 3 is more than this engine allows (allowed range: 0 <= "
                                       "top_logprobs <= 2")  # fmt: skip
    assert client.post("/v1/chat/completions", json={**body, "top_logprobs": 2}).status_code == 200
