"""Structured outputs keep async scheduling's overlap, on a tiny random Llama with a real
tokenizer.

A structured request whose token of step n is still in flight when step n+1 is scheduled
makes step n+1 ``pending_structured_output_tokens``: its forward is launched, step n's
tokens are applied, then the bitmask of n+1 is filled and n+1 sampled. Checked here: the
greedy constrained tokens (JSON schema, regex, choice, mixed in one batch with
unconstrained requests) are those of the synchronous engine, with the engine core in
this process, in its own process, and with two tensor-parallel ranks; a step stays in
flight between ``step()`` calls while structured requests run; a request whose grammar
terminates with a step of it already scheduled, and an aborted structured request, leave
the others' tokens alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvloom import LLM, SamplingParams, StructuredOutputsParams
from kvloom.testing.json_schema import schema_errors
from tests.helpers.model_fixtures import tiny_model_dir

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "kind", "ok"],
    "additionalProperties": False,
}
PATTERN = r"[a-z]{3,8}( [a-z]{2,6}){2}\."
CHOICES = ["yes please", "no thanks", "maybe later on"]
PROMPTS = ["Describe a pet as JSON.", "Tell me three words.", "Will you come?", "Plain text here", "Another plain"]


def _params() -> list[SamplingParams]:
    def so(**kind: Any) -> StructuredOutputsParams:
        return StructuredOutputsParams(**kind)

    return [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=so(regex=PATTERN)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(choice=CHOICES)),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # outlives the structured ones
    ]


def _llm(**kwargs: Any) -> LLM:
    return LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True,
               **kwargs)  # fmt: skip


def _generate(llm: LLM) -> list[tuple[list[int], str, str | None]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _check_constrained(result: list[tuple[list[int], str, str | None]]) -> None:
    (_, text_json, reason_json), (_, text_regex, reason_regex), (_, text_choice, reason_choice) = result[:3]
    assert reason_json == reason_regex == reason_choice == "stop", result[:3]
    assert schema_errors(json.loads(text_json), SCHEMA) == [], text_json
    assert re.fullmatch(PATTERN, text_regex), text_regex
    assert text_choice in CHOICES


@pytest.fixture(scope="module")
def sync_result() -> list[tuple[list[int], str, str | None]]:
    llm = _llm()
    try:
        result = _generate(llm)
    finally:
        llm.llm_engine.shutdown()
    _check_constrained(result)
    assert len(result[4][0]) == 40
    return result


@pytest.fixture()
def deferrals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[set[str], set[str]]]:
    """Every bitmask filled after the step before it (``Scheduler.get_grammar_bitmask``),
    in engine cores of this process: (the step's structured requests, those given a row)."""
    from kvloom.scheduler.scheduler import Scheduler

    calls: list[tuple[set[str], set[str]]] = []
    fill = Scheduler.get_grammar_bitmask

    def spy(self: Scheduler, so: Any) -> Any:
        grammar = fill(self, so)
        calls.append((set(so.structured_output_request_ids),
                      set(grammar.structured_output_request_ids) if grammar is not None else set()))  # fmt: skip
        return grammar

    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", spy)
    return calls


def test_in_process_tokens_match_sync_and_a_step_stays_in_flight(sync_result, deferrals, monkeypatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the core's state is read here
    llm = _llm(async_scheduling=True)
    engine = llm.llm_engine
    core = engine.engine_core.core
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), prompt, params)
    results: dict[str, Any] = {}
    in_flight_with_structured = []
    while engine.has_unfinished_requests():
        structured_running = any(r.request_id in ("0", "1", "2") for r in core.scheduler.running)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        if structured_running:
            in_flight_with_structured.append(len(core._in_flight))
    got = [(list(results[str(i)].token_ids), results[str(i)].text, results[str(i)].finish_reason)
           for i in range(len(PROMPTS))]  # fmt: skip
    assert got == sync_result
    # Between step() calls a step stays launched while structured requests run.
    assert in_flight_with_structured and max(in_flight_with_structured) == 1
    assert sum(in_flight_with_structured) >= len(in_flight_with_structured) - 2
    # Bitmasks were filled after the previous step's tokens, and the requests whose grammar
    # terminated with a step of theirs already scheduled got no row in it.
    assert len(deferrals) >= 10
    dropped = set().union(*(scheduled - rows for scheduled, rows in deferrals))
    assert dropped == {"0", "1", "2"}
    assert not core.has_work()
    llm.llm_engine.shutdown()


def test_engine_core_process_tokens_match_sync(sync_result) -> None:
    llm = _llm(async_scheduling=True)  # the engine core in its own process (the default)
    try:
        assert _generate(llm) == sync_result
    finally:
        llm.llm_engine.shutdown()


def test_aborted_structured_request_leaves_the_others_alone(sync_result, deferrals, monkeypatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = _llm(async_scheduling=True)
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), prompt, params)
    results: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        steps += 1
        if steps == 6:  # mid-decode, with a step of the JSON request in flight
            assert engine.engine_core.core._in_flight
            engine.abort_request(["0"])
    assert set(results) == {"1", "2", "3", "4"}
    for i in (1, 2, 3, 4):
        assert (list(results[str(i)].token_ids), results[str(i)].text, results[str(i)].finish_reason) == sync_result[i]
    assert any("0" in scheduled for scheduled, _ in deferrals)
    assert not engine.engine_core.core.has_work()
    llm.llm_engine.shutdown()


def test_tensor_parallel_tokens_match_sync(sync_result, deferrals, monkeypatch) -> None:
    """Two mp ranks: a deferred step's forward and its sampling are two calls to every rank."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    llm = _llm(async_scheduling=True, tensor_parallel_size=2)
    try:
        assert _generate(llm) == sync_result
    finally:
        llm.llm_engine.shutdown()
    assert any(rows for _, rows in deferrals)
