"""OutputProcessor tests: engine-core outputs (made by hand, as the core would send them)
in, RequestOutputs out, with a real tokenizer."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.tokenizer_fixtures import byte_level_tokenizer, smollm2_tokenizer

from kvloom.engine.output_processor import OutputProcessor
from kvloom.engine.parallel_sampling import ParentRequest, child_request_id
from kvloom.metrics.stats import IterationStats
from kvloom.outputs import EngineCoreOutput, PoolingRequestOutput, TokenLogprobs
from kvloom.request import EngineCoreRequest, FinishReason
from kvloom.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
TEXT = " The capital of France is Paris 🇫🇷 — 日本語 too."


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def make_request(tok, request_id="r", prompt="Question:", **params):
    ids = tok.encode(prompt, add_special_tokens=False) if tok is not None else [5, 6, 7]
    return EngineCoreRequest(request_id, ids, SamplingParams(**params), eos_token_id=getattr(tok, "eos_token_id", 0))


def step(op, outputs, ts=0.0, stats=None):
    return op.process_outputs(outputs, engine_core_timestamp=ts, iteration_stats=stats)


def stream(op, request_id, token_ids, finish=FinishReason.LENGTH, chunk=1, stop_reason=None):
    """Send token_ids one chunk per step, finishing with ``finish``; collect all outputs."""
    outs, to_abort = [], []
    for i in range(0, len(token_ids), chunk):
        last = i + chunk >= len(token_ids)
        o = EngineCoreOutput(request_id, token_ids[i : i + chunk], finish_reason=finish if last else None,
                             stop_reason=stop_reason if last else None)
        res = step(op, [o], ts=float(i))
        outs += res.request_outputs
        to_abort += res.reqs_to_abort
        if not op.has_unfinished_requests():
            break
    return outs, to_abort


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_output_kinds_give_the_same_text(tok, kind):
    ids = tok.encode(TEXT, add_special_tokens=False)
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, max_tokens=len(ids), output_kind=kind), "Question:")
    outs, to_abort = stream(op, "r", ids)
    assert not to_abort and not op.has_unfinished_requests()
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert all(o.request_id == "r" and o.prompt == "Question:" for o in outs)
    if kind == FINAL:
        assert len(outs) == 1
    else:
        assert len(outs) == len(ids)
    if kind == DELTA:
        text = "".join(o.outputs[0].text for o in outs)
        token_ids = [t for o in outs for t in o.outputs[0].token_ids]
    else:
        text, token_ids = outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids
        if kind == CUM:  # cumulative texts only grow
            for a, b in zip(outs, outs[1:]):
                assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert text == TEXT and token_ids == ids
    assert "\ufffd" not in "".join(o.outputs[0].text for o in outs)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.stop_reason is None and final.index == 0
    assert final.cumulative_logprob is None and final.logprobs is None


def test_stop_string_finishes_and_asks_core_to_abort(tok):
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, stop=["three"], output_kind=DELTA), None)
    outs, to_abort = stream(op, "r", ids, finish=None)
    assert to_abort == ["r"]
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "three"
    assert "".join(o.outputs[0].text for o in outs) == " one two "
    assert not op.has_unfinished_requests()
    # a late output of the aborted request is ignored
    assert step(op, [EngineCoreOutput("r", [42])]).request_outputs == []


def test_stop_string_before_the_core_finished_wins(tok):
    ids = tok.encode(" one two three", add_special_tokens=False)
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, stop=["two"], output_kind=FINAL), None)
    # the core finished the request for length in the same step: no abort needed
    res = step(op, [EngineCoreOutput("r", ids, finish_reason=FinishReason.LENGTH)])
    c = res.request_outputs[0].outputs[0]
    assert res.reqs_to_abort == []
    assert c.text == " one " and c.finish_reason == "stop" and c.stop_reason == "two"


def test_stop_token_id_from_core_is_kept_but_not_shown(tok):
    body = tok.encode(" yes", add_special_tokens=False)
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, output_kind=FINAL), None)
    outs, to_abort = stream(op, "r", body + [tok.eos_token_id], finish=FinishReason.STOP, chunk=len(body) + 1)
    assert not to_abort
    c = outs[0].outputs[0]
    assert c.token_ids == body + [tok.eos_token_id] and c.text == " yes"
    assert c.finish_reason == "stop" and c.stop_reason is None


def lp(token_ids, logprobs, rank):
    return TokenLogprobs(token_ids=token_ids, logprobs=logprobs, ranks=[rank] + list(range(1, len(token_ids))))


@pytest.mark.parametrize("kind", [CUM, DELTA])
def test_logprobs_and_prompt_logprobs(tok, kind):
    a, b = tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(" London", add_special_tokens=False)[0]
    op = OutputProcessor(tok)
    req = make_request(tok, logprobs=1, prompt_logprobs=1, output_kind=kind)
    op.add_request(req, "Question:")
    p = req.prompt_token_ids
    # chunked prefill: a first chunk of prompt logprobs arrives without tokens (nothing shown yet)
    res = step(op, [EngineCoreOutput("r", [], new_prompt_logprobs=[lp([p[1], a], [-2.0, -1.0], 3)])])
    assert res.request_outputs == []
    rest = [lp([p[i], a], [-0.5, -0.1], 2) for i in range(2, len(p))]
    res = step(op, [EngineCoreOutput("r", [a], new_logprobs=[lp([a, a], [-0.25, -0.25], 1)], new_prompt_logprobs=rest)])
    first = res.request_outputs[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(p)
    assert first.prompt_logprobs[1][p[1]].logprob == -2.0 and first.prompt_logprobs[1][p[1]].rank == 3
    assert first.prompt_logprobs[1][a].decoded_token == " Paris"
    res = step(op, [EngineCoreOutput("r", [b], new_logprobs=[lp([b, a], [-1.5, -0.5], 2)], finish_reason=FinishReason.LENGTH)])
    second = res.request_outputs[0]
    c = second.outputs[0]
    assert c.cumulative_logprob == pytest.approx(-1.75)
    if kind == DELTA:
        assert second.prompt_logprobs is None  # delivered once
        assert len(c.logprobs) == 1 and c.token_ids == [b]
        entry = c.logprobs[0]
    else:
        assert len(second.prompt_logprobs) == len(p)
        assert len(c.logprobs) == 2 and c.token_ids == [a, b]
        assert list(c.logprobs[0]) == [a] and c.logprobs[0][a].rank == 1
        entry = c.logprobs[1]
    assert list(entry) == [b, a]  # the sampled token first, then the top-1
    assert entry[b].logprob == -1.5 and entry[b].rank == 2 and entry[b].decoded_token == " London"
    assert entry[a].rank == 1


def test_logprobs_of_tokens_after_a_stop_string_are_dropped():
    tok = byte_level_tokenizer()
    ids = tok.encode(" a b c", add_special_tokens=False)
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, stop=["b"], logprobs=0, output_kind=FINAL), None)
    entries = [lp([t], [-1.0], 1) for t in ids]
    res = step(op, [EngineCoreOutput("r", ids, new_logprobs=entries)])
    c = res.request_outputs[0].outputs[0]
    assert c.text == " a " and res.reqs_to_abort == ["r"]
    assert len(c.logprobs) == len(c.token_ids) < len(ids)
    assert c.cumulative_logprob == pytest.approx(-1.0 * len(c.token_ids))


def test_queue_receives_outputs_instead_of_the_return_value(tok):
    class ListQueue:
        def __init__(self):
            self.items = []

        def put(self, item):
            self.items.append(item)

    q = ListQueue()
    op = OutputProcessor(tok)
    op.add_request(make_request(tok, "streamed", output_kind=DELTA), None, queue=q)
    op.add_request(make_request(tok, "plain", output_kind=DELTA), None)
    ids = tok.encode(" hi there", add_special_tokens=False)
    res = step(op, [EngineCoreOutput("streamed", ids[:1]), EngineCoreOutput("plain", ids[:1])])
    assert [o.request_id for o in res.request_outputs] == ["plain"]
    assert [o.request_id for o in q.items] == ["streamed"]
    # aborting a queued request wakes its consumer with a final aborted output
    assert op.abort_requests(["streamed", "unknown"]) == ["streamed"]
    assert q.items[-1].finished and q.items[-1].outputs[0].finish_reason == "abort"
    assert op.get_num_unfinished_requests() == 1


def test_without_tokenizer_token_ids_only():
    op = OutputProcessor(None)
    req = EngineCoreRequest("r", [5, 6, 7], SamplingParams(logprobs=0, output_kind=FINAL))
    op.add_request(req, None)
    res = step(op, [EngineCoreOutput("r", [8, 9], new_logprobs=[lp([8], [-0.5], 1), lp([9], [-0.25], 1)],
                                      finish_reason=FinishReason.LENGTH)])
    c = res.request_outputs[0].outputs[0]
    assert c.text == "" and c.token_ids == [8, 9]
    assert c.logprobs[0][8].decoded_token is None and c.cumulative_logprob == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="stop"):
        op.add_request(EngineCoreRequest("s", [1], SamplingParams(stop=["x"])), None)


def test_pooling_request_output():
    op = OutputProcessor(None)
    op.add_request(EngineCoreRequest("e", [1, 2, 3], None, pooling_params=PoolingParams()), None)
    vec = torch.tensor([0.6, 0.8])
    res = step(op, [EngineCoreOutput("e", [], pooling_output=vec, finish_reason=FinishReason.STOP)])
    (out,) = res.request_outputs
    assert isinstance(out, PoolingRequestOutput) and out.finished and torch.equal(out.outputs.data, vec)
    assert out.prompt_token_ids == [1, 2, 3] and not op.has_unfinished_requests()


def test_duplicate_request_id_is_an_error(tok):
    op = OutputProcessor(tok)
    op.add_request(make_request(tok), None)
    with pytest.raises(ValueError, match="already running"):
        op.add_request(make_request(tok), None)


# --------------------------------------------------------------- parallel sampling


def add_parent(op, tok, n=3, queue=None, **params):
    parent = ParentRequest(make_request(tok, "p", n=n, **params))
    children = parent.child_requests()
    for index, child in children:
        op.add_request(child, "Question:", parent, index, queue)
    return parent, children


def test_parent_fans_out_children_with_derived_ids_and_seeds(tok):
    parent = ParentRequest(make_request(tok, "p", n=3, seed=10, prompt_logprobs=2))
    children = parent.child_requests()
    assert [c.request_id for _, c in children] == [child_request_id(i, "p") for i in range(3)] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for _, c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for _, c in children)
    assert [c.sampling_params.prompt_logprobs for _, c in children] == [2, None, None]
    assert all(c.prompt_token_ids == parent.request.prompt_token_ids for _, c in children)
    unseeded = ParentRequest(make_request(tok, "q", n=2)).child_requests()
    assert all(c.sampling_params.seed is None for _, c in unseeded)
    top = ParentRequest(make_request(tok, "t", n=2, seed=2**63 - 1)).child_requests()
    assert top[1][1].sampling_params.seed == -(2**63 - 1)  # wrapped, still valid


def child_outputs(tok):
    texts = [" red apple", " green pear tree", " blue"]
    return [tok.encode(t, add_special_tokens=False) for t in texts], texts


def run_parent(op, tok, parent_id="p"):
    ids, _ = child_outputs(tok)
    results = []
    for s in range(max(len(x) for x in ids)):
        outs = []
        for i, toks in enumerate(ids):
            if s < len(toks):
                last = s == len(toks) - 1
                outs.append(EngineCoreOutput(f"{i}_{parent_id}", [toks[s]], finish_reason=FinishReason.LENGTH if last else None))
        results.append(step(op, outs).request_outputs)
    return results


def test_parent_final_only_aggregates_all_children(tok):
    op = OutputProcessor(tok)
    add_parent(op, tok, output_kind=FINAL)
    results = run_parent(op, tok)
    flat = [o for r in results for o in r]
    assert len(flat) == 1 and results[-1] == flat
    out = flat[0]
    _, texts = child_outputs(tok)
    assert out.request_id == "p" and out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.text for c in out.outputs] == texts
    assert not op.has_unfinished_requests() and not op.parent_requests


def test_parent_cumulative_and_delta(tok):
    _, texts = child_outputs(tok)
    op = OutputProcessor(tok)
    add_parent(op, tok, output_kind=CUM)
    results = run_parent(op, tok)
    assert all(len(r) == 1 for r in results)  # one parent output per step
    assert [r[0].finished for r in results] == [False] * (len(results) - 1) + [True]
    assert [c.text for c in results[-1][0].outputs] == texts

    op = OutputProcessor(tok)
    add_parent(op, tok, output_kind=DELTA)
    results = run_parent(op, tok)
    assert all(len(r) == 1 and r[0].request_id == "p" for r in results)
    joined = {}
    for r in results:
        for c in r[0].outputs:
            joined[c.index] = joined.get(c.index, "") + c.text
    assert [joined[i] for i in range(3)] == texts
    # the shortest child finished early; the parent only at the end
    assert any(c.finish_reason == "length" for c in results[0][0].outputs) and not results[0][0].finished
    assert results[-1][0].finished


def test_parent_stats_and_abort(tok):
    class ListQueue(list):
        def put(self, item):
            self.append(item)

    q = ListQueue()
    op = OutputProcessor(tok)
    add_parent(op, tok, n=2, queue=q, output_kind=DELTA)
    ids = tok.encode(" x", add_special_tokens=False)
    stats = IterationStats()
    res = step(op, [EngineCoreOutput("0_p", ids, finish_reason=FinishReason.LENGTH)], stats=stats)
    assert res.request_outputs == [] and len(q) == 1 and not q[0].finished
    assert stats.n_params_iter == []  # the parent is not finished yet
    assert sorted(op.abort_requests(["p"])) == ["1_p"]
    assert q[-1].finished and q[-1].outputs[0].finish_reason == "abort" and q[-1].outputs[0].index == 1
    assert not op.has_unfinished_requests() and not op.parent_requests

    op = OutputProcessor(tok)
    add_parent(op, tok, n=2)
    stats = IterationStats()
    step(op, [EngineCoreOutput("0_p", ids * 3, finish_reason=FinishReason.LENGTH),
              EngineCoreOutput("1_p", ids, finish_reason=FinishReason.STOP)], stats=stats)
    assert stats.n_params_iter == [2] and stats.max_num_generation_tokens_iter == [3]
    assert [f.finish_reason for f in stats.finished_requests] == [FinishReason.LENGTH, FinishReason.STOP]


def test_request_metrics_are_wall_clock(tok):
    from kvloom.request import EngineCoreEvent, EngineCoreEventType

    op = OutputProcessor(tok)
    req = make_request(tok, output_kind=FINAL)
    req.arrival_time = 1000.0
    op.add_request(req, None)
    ids = tok.encode(" a b", add_special_tokens=False)
    stats = IterationStats(iteration_timestamp=1005.0)
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 50.0), EngineCoreEvent(EngineCoreEventType.SCHEDULED, 51.0)]
    step(op, [EngineCoreOutput("r", ids[:1], events=events)], ts=53.0, stats=stats)
    stats = IterationStats(iteration_timestamp=1006.0)
    res = step(op, [EngineCoreOutput("r", ids[1:], finish_reason=FinishReason.LENGTH)], ts=54.0, stats=stats)
    m = res.request_outputs[0].metrics
    assert m.arrival_time == 1000.0
    assert m.first_scheduled_time == pytest.approx(1003.0)  # 2 s before the first token's step
    assert m.first_token_time == 1005.0 and m.last_token_time == 1006.0 and m.finished_time == 1006.0
    assert math.isclose(stats.finished_requests[0].e2e_latency, 6.0)


def test_sampler_logprobs_flow_into_request_outputs(tok):
    # The sampler's per-request logprobs (ModelRunnerOutput.logprobs) are what the core
    # forwards as EngineCoreOutput.new_logprobs; the user sees them as vLLM dicts.
    from kvloom.sample import Sampler, SamplingMetadata

    vocab = len(tok)
    op = OutputProcessor(tok)
    params = [SamplingParams(temperature=0.0, logprobs=2, max_tokens=3, output_kind=FINAL), SamplingParams(max_tokens=3)]
    reqs = [make_request(tok, f"r{i}", **p.model_dump()) for i, p in enumerate(params)]
    for r in reqs:
        op.add_request(r, None)
    g = torch.Generator().manual_seed(0)
    outputs_so_far = [[], []]
    all_logits = []
    for s in range(3):
        logits = torch.randn(2, vocab, generator=g) * 3
        all_logits.append(logits[0])
        meta = SamplingMetadata.build(params, [r.prompt_token_ids for r in reqs], outputs_so_far, {}, vocab, "cpu",
                                      [tok.eos_token_id] * 2)
        out = Sampler()(logits, meta)
        sampled = out.sampled_token_ids.tolist()
        lps = out.logprobs_lists()
        assert lps[1] is None
        finish = FinishReason.LENGTH if s == 2 else None
        core_outs = [EngineCoreOutput(r.request_id, [t], new_logprobs=lp, finish_reason=finish)
                     for r, t, lp in zip(reqs, sampled, lps)]
        for i, t in enumerate(sampled):
            outputs_so_far[i].append(t)
        res = step(op, core_outs)
    (final,) = [o for o in res.request_outputs if o.request_id == "r0"]
    c = final.outputs[0]
    assert c.token_ids == outputs_so_far[0]
    ref = [torch.log_softmax(x.double(), dim=0) for x in all_logits]
    assert c.cumulative_logprob == pytest.approx(sum(ref[i][t].item() for i, t in enumerate(c.token_ids)), abs=1e-4)
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert next(iter(entry)) == t and entry[t].rank == 1  # greedy, raw logits: the argmax
        assert len(entry) == 2  # sampled token == top-1, plus top-2
        assert entry[t].decoded_token == tok.decode([t])


def test_merged_delta_outputs_keep_every_field_of_the_newer_one():
    """merge_delta_outputs builds its outputs field by field (for speed): every field not
    concatenated comes from the newer output, and a field added to the dataclasses later
    must be handled there (this test lists them)."""
    import dataclasses

    from kvloom.engine.output_processor import merge_delta_outputs
    from kvloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason", "lora_request"]
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "num_cached_tokens",
        "metrics", "lora_request", "kv_transfer_params"]  # fmt: skip
    assert [f.name for f in dataclasses.fields(RequestMetrics)] == [  # RequestState.metrics_snapshot copies them
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time"]

    def output(text: str, ids: list[int], finished: bool, tag: str) -> RequestOutput:
        seqs = [CompletionOutput(i, f"{text}{i}", [*ids, i], -1.5 * len(ids), [{t: Logprob(-0.5)} for t in ids],
                                 "stop" if finished else None, f"s{tag}" if finished else None, f"lora-{tag}")
                for i in (1, 0)]  # fmt: skip
        return RequestOutput("r", f"prompt-{tag}", [1, 2], [None, {2: Logprob(-1.0)}] if tag == "b" else None, seqs,
                             finished, 3 if tag == "b" else 0, RequestMetrics(arrival_time=1.0), f"lora-{tag}")  # fmt: skip

    older, newer = output("a", [5], False, "a"), output("b", [6, 7], True, "b")
    merged = merge_delta_outputs(older, newer)
    assert [c.index for c in merged.outputs] == [0, 1]
    for c in merged.outputs:
        new = next(n for n in newer.outputs if n.index == c.index)
        old = next(o for o in older.outputs if o.index == c.index)
        assert c.text == old.text + new.text and c.token_ids == old.token_ids + new.token_ids
        assert c.logprobs == old.logprobs + new.logprobs
        assert (c.cumulative_logprob, c.finish_reason, c.stop_reason, c.lora_request) == (
            new.cumulative_logprob, new.finish_reason, new.stop_reason, new.lora_request)
    assert merged.prompt_logprobs == newer.prompt_logprobs
    assert (merged.request_id, merged.prompt, merged.prompt_token_ids, merged.finished, merged.num_cached_tokens,
            merged.metrics, merged.lora_request) == (newer.request_id, newer.prompt, newer.prompt_token_ids, True, 3,
                                                     newer.metrics, newer.lora_request)  # fmt: skip
    assert older.outputs[0].token_ids == [5, 1] and older.outputs[0].text == "a1"  # inputs untouched
    # The KV connector's params come with the final output: the newer one's, else the older one's.
    newer.kv_transfer_params = {"remote": "b"}
    assert merge_delta_outputs(older, newer).kv_transfer_params == {"remote": "b"}
    older.kv_transfer_params, newer.kv_transfer_params = {"remote": "a"}, None
    assert merge_delta_outputs(older, newer).kv_transfer_params == {"remote": "a"}
