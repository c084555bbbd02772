"""The structured-output manager with the scheduler: WAITING_FOR_FSM while a grammar
compiles, a grammar that fails fails its request alone, matchers kept in step with the
output tokens across preemption (rolled back when tokens are dropped), the request
finished when its grammar terminates. Real xgrammar on the default model's tokenizer;
a stand-in runner samples uniformly among the tokens the step's bitmask allows."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import xgrammar as xgr

from kvloom.outputs import ModelRunnerOutput
from kvloom.request import FinishReason, Request, RequestStatus
from kvloom.sampling_params import SamplingParams, StructuredOutputsParams
from kvloom.scheduler.scheduler import Scheduler
from kvloom.structured_output.bitmask import allowed_mask
from kvloom.structured_output.manager import StructuredOutputManager
from kvloom.structured_output.xgrammar_backend import XgrammarBackend
from tests.helpers.fake_model import make_configs
from tests.helpers.tokenizer_fixtures import smollm2_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


class GatedBackend(XgrammarBackend):
    """xgrammar, except that compiling waits for ``gate`` and a regex "FAIL" raises."""

    gate = threading.Event()

    def compile(self, params: StructuredOutputsParams):
        assert self.gate.wait(30)
        if params.regex == "FAIL":
            raise RuntimeError("[12:00:00] /project/cpp/x.cc:1: compiling FAIL went wrong")
        return super().compile(params)


def make(tokenizer, num_blocks: int = 64, backend=XgrammarBackend, **config) -> tuple[Scheduler, StructuredOutputManager]:
    manager = StructuredOutputManager("xgrammar", len(tokenizer), tokenizer_loader=lambda: tokenizer)
    manager.backend_cls = backend
    sc, cc = make_configs(**config)
    return Scheduler(sc, cc, num_blocks=num_blocks, structured_output_manager=manager), manager


def structured(max_tokens: int = 40, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind))


def step(scheduler: Scheduler, vocab: int, g: torch.Generator, plain_token: int = 7):
    """One step: structured requests sample uniformly among their allowed tokens."""
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        elif req_id in so.structured_output_request_ids:
            row = so.structured_output_request_ids[req_id]
            allowed = allowed_mask(so.grammar_bitmask[row : row + 1], vocab)[0]
            choices = allowed.nonzero().flatten()
            sampled.append([int(choices[torch.randint(len(choices), (1,), generator=g)])])
        else:
            sampled.append([plain_token])
    return so, scheduler.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def run(scheduler: Scheduler, vocab: int, seed: int = 0, max_steps: int = 500) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, object] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return {"tokens": tokens, "finished": finished}
        _, out = step(scheduler, vocab, g)
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = (o.finish_reason, o.error)
        time.sleep(0.001)
    raise AssertionError("the requests did not finish")


def test_a_request_waits_for_its_grammar_while_others_run(tokenizer) -> None:
    GatedBackend.gate.clear()
    scheduler, manager = make(tokenizer, backend=GatedBackend)
    scheduler.add_request(Request("s", [1, 2, 3], structured(regex="[a-z]{4}")))
    scheduler.add_request(Request("p", [1, 2, 3], SamplingParams(max_tokens=3)))
    assert scheduler.requests["s"].status == RequestStatus.WAITING_FOR_FSM
    g = torch.Generator().manual_seed(0)
    so, _ = step(scheduler, len(tokenizer), g)
    assert list(so.num_scheduled_tokens) == ["p"] and so.grammar_bitmask is None
    assert scheduler.requests["s"].status == RequestStatus.WAITING_FOR_FSM
    GatedBackend.gate.set()
    result = run(scheduler, len(tokenizer))
    text = tokenizer.decode(result["tokens"]["s"], skip_special_tokens=True)
    assert re.fullmatch("[a-z]{4}", text), text
    assert result["finished"]["s"][0] == FinishReason.STOP
    assert not manager.grammars and not manager._pending


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tokenizer) -> None:
    GatedBackend.gate.set()
    scheduler, _ = make(tokenizer, backend=GatedBackend)
    scheduler.add_request(Request("bad", [1, 2], structured(regex="FAIL")))
    scheduler.add_request(Request("good", [1, 2], structured(choice=["yes", "no"])))
    scheduler.add_request(Request("plain", [1, 2], SamplingParams(max_tokens=2)))
    result = run(scheduler, len(tokenizer))
    reason, error = result["finished"]["bad"]
    assert reason == FinishReason.ERROR
    assert error == "structured_outputs.regex: the grammar failed to compile: compiling FAIL went wrong"
    assert tokenizer.decode(result["tokens"]["good"], skip_special_tokens=True) in ("yes", "no")
    assert result["finished"]["good"][0] == FinishReason.STOP
    assert result["tokens"]["plain"] == [7, 7]


def test_matchers_follow_their_requests_through_preemption(tokenizer) -> None:
    """Too few KV blocks for all three: requests are preempted and recomputed with their
    output so far; every matcher stays in step and every output matches its regex."""
    scheduler, _ = make(tokenizer, num_blocks=10, block_size=4, max_num_batched_tokens=16)
    pattern = "[a-z]{12}-[0-9]{8}"
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3, 4, 5, 6], structured(max_tokens=30, regex=pattern)))
    preempted: list[str] = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request, now: (preempted.append(request.request_id), preempt(request, now))[1]
    result = run(scheduler, len(tokenizer), seed=1)
    assert preempted
    for i in range(3):
        text = tokenizer.decode(result["tokens"][f"r{i}"], skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text


def test_a_matcher_ahead_of_its_request_is_rolled_back(tokenizer) -> None:
    scheduler, manager = make(tokenizer)
    request = Request("s", [1, 2], structured(regex="[a-z]+[0-9]+"))
    scheduler.add_request(request)
    while manager.grammar_ready(request) is False:
        time.sleep(0.01)
    ids = tokenizer.encode("abc12", add_special_tokens=False)
    request.append_output_token_ids(ids)
    _, with_all = manager.grammar_bitmask([request])
    assert manager.grammars["s"].num_processed_tokens == len(ids)
    # Tokens dropped (as a recompute that keeps fewer tokens would): the matcher follows.
    request.output_token_ids = ids[:1]
    request.all_token_ids = [1, 2] + ids[:1]
    _, rolled_back = manager.grammar_bitmask([request])
    assert manager.grammars["s"].num_processed_tokens == 1
    fresh = xgr.GrammarMatcher(manager.backend.compile(request.sampling_params.structured_outputs))
    assert fresh.accept_token(ids[0])
    expected = xgr.allocate_token_bitmask(1, len(tokenizer))
    fresh.fill_next_token_bitmask(expected)
    assert torch.equal(rolled_back, expected) and not torch.equal(with_all, rolled_back)



def test_identical_grammars_compile_once_and_the_stats_say_so(tokenizer) -> None:
    scheduler, manager = make(tokenizer)
    for i in range(3):  # as n=3 siblings would
        scheduler.add_request(Request(f"s{i}", [1, 2], structured(choice=["on", "off"])))
    scheduler.add_request(Request("t", [1, 2], structured(regex="[0-9]")))
    first = scheduler.make_stats()
    assert (first.structured_output_cache_queries, first.structured_output_cache_hits) == (4, 2)
    while manager._pending and any(not f.done() for f in manager._pending.values()):
        manager.wait_for_compile(0.1)
    second = scheduler.make_stats()
    compile_times = first.structured_output_compile_times + second.structured_output_compile_times
    assert len(compile_times) == 2 and all(t > 0 for t in compile_times)  # one per distinct grammar
    assert second.structured_output_cache_queries == 0
    result = run(scheduler, len(tokenizer))
    texts = {tokenizer.decode(result["tokens"][f"s{i}"], skip_special_tokens=True) for i in range(3)}
    assert texts <= {"on", "off"} and tokenizer.decode(result["tokens"]["t"], skip_special_tokens=True).isdigit()


def test_async_scheduling_defers_the_bitmask_of_a_step_behind_an_in_flight_token(tokenizer) -> None:
    """Scheduled while its previous token is in flight, a structured request's step has no
    bitmask yet; it is filled once that token is applied, from the advanced matcher. A
    request that finished (here: aborted) meanwhile gets no row."""
    scheduler, manager = make(tokenizer)
    scheduler.async_scheduling = True
    vocab = len(tokenizer)
    scheduler.add_request(Request("s", [1, 2], structured(regex="[a-z]{30}")))
    scheduler.add_request(Request("p", [1, 2], SamplingParams(max_tokens=50)))
    manager.wait_for_compile(60)
    assert manager._pending["s"].done()
    first = scheduler.schedule()  # the prefills: every token known, the bitmask filled now
    assert list(first.num_scheduled_tokens) == ["s", "p"]
    assert not first.pending_structured_output_tokens and first.grammar_bitmask is not None
    second = scheduler.schedule()  # behind the prefill's token, still in flight
    assert second.pending_structured_output_tokens and second.grammar_bitmask is None
    assert set(second.structured_output_request_ids) == {"s"}
    allowed = allowed_mask(first.grammar_bitmask, vocab)[0].nonzero().flatten().tolist()
    token = allowed[0]
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=list(first.num_scheduled_tokens),
                                                          sampled_token_ids=[[token], [7]]))  # fmt: skip
    grammar = scheduler.get_grammar_bitmask(second)
    assert grammar is not None and grammar.structured_output_request_ids == {"s": 0}
    fresh = xgr.GrammarMatcher(manager.backend.compile(structured(regex="[a-z]{30}").structured_outputs))
    assert fresh.accept_token(token)
    expected = xgr.allocate_token_bitmask(1, vocab)
    fresh.fill_next_token_bitmask(expected)
    assert torch.equal(grammar.grammar_bitmask, expected)
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_grammar_bitmask(second) is None and "s" not in manager.grammars


def test_a_structural_tag(tokenizer) -> None:
    scheduler, _ = make(tokenizer)
    tag = {"type": "structural_tag",
           "format": {"type": "tag", "begin": "<id>", "content": {"type": "regex", "pattern": "[0-9]{3}"}, "end": "</id>"}}
    scheduler.add_request(Request("s", [1, 2], structured(structural_tag=tag)))
    result = run(scheduler, len(tokenizer), seed=3)
    assert re.fullmatch(r"<id>[0-9]{3}</id>", tokenizer.decode(result["tokens"]["s"], skip_special_tokens=True))
    assert result["finished"]["s"][0] == FinishReason.STOP


@pytest.fixture(scope="module")
def xgrammar_backend(tokenizer) -> XgrammarBackend:
    backend = XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    backend.eos_token_id = tokenizer.eos_token_id
    return backend


@pytest.mark.parametrize("kind", [{"json": {"type": "object", "properties": {"a": {"type": "array"}}}},
                                  {"json_object": True}])
def test_json_grammars_bound_runs_of_whitespace(xgrammar_backend, kind) -> None:
    """A JSON answer may be pretty-printed, but a run of blank lines cannot eat its token
    budget (the tour's 380 newlines); disable_any_whitespace makes it compact."""
    from kvloom.structured_output.xgrammar_backend import MAX_JSON_WHITESPACE

    backend = xgrammar_backend

    def accepts(text: str, **options) -> bool:
        matcher = backend.new_grammar(backend.compile(StructuredOutputsParams(**kind, **options))).matcher
        return matcher.accept_string(text) and matcher.accept_token(backend.eos_token_id)

    pretty = '{\n  "a": [\n    1,\n    {"b": null}\n  ]\n}'
    assert accepts(pretty) and accepts('{"a": [1]}')
    assert accepts('{"a":' + " " * MAX_JSON_WHITESPACE + "[]}")
    assert not accepts('{"a":' + " " * (MAX_JSON_WHITESPACE + 1) + "[]}")
    assert not accepts("{" + "\n" * 380 + "}")
    assert accepts('{"a": [1, {"b": null}]}', disable_any_whitespace=True)  # xgrammar's default separators
    assert not accepts(pretty, disable_any_whitespace=True)
