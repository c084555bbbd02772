"""Scheduler behaviour: budgets, chunked prefill, preemption, aborts, stop conditions, events."""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.fake_model import (
    FakeModelRunner,
    make_configs,
    reference_generate,
    run_to_completion,
    sample,
    speculative_config,
    step,
)

from tests.helpers.fake_model import compute_slot_mapping
from kvloom.outputs import EngineCoreOutputs, ModelRunnerOutput
from kvloom.request import EngineCoreEventType, FinishReason, Request, RequestStatus
from kvloom.sampling_params import PoolingParams, SamplingParams
from kvloom.scheduler.output import SchedulerOutput
from kvloom.scheduler.scheduler import Scheduler


def greedy(max_tokens: int | None = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def make_scheduler(num_blocks: int = 64, speculative=None, **config) -> Scheduler:
    sc, cc = make_configs(**config)
    return Scheduler(sc, cc, num_blocks=num_blocks, speculative_config=speculative)


def by_id(out: EngineCoreOutputs) -> dict:
    return {o.request_id: o for o in out.outputs}


# ----------------------------------------------------------------- admission


def test_add_request_refuses_a_request_id_in_use() -> None:
    """(The prompt's length is the engine core's to check, with the other model-bounded
    rules: tests/engine/test_request_isolation.py.)"""
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(Request("a", list(range(16)), greedy()))
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_request(Request("a", [1], greedy()))
    assert scheduler.get_num_unfinished_requests() == 1


def test_chunked_prefill_off_needs_a_budget_for_max_model_len() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_model_len \(64\)"):
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64)


def test_three_prompt_example_block_tables_and_slot_mappings() -> None:
    """The seed's three prompts through the scheduler (kvloom does not reserve a null
    block, so block ids start at 0 rather than the seed's 1)."""
    scheduler = make_scheduler(block_size=4)
    prompts = {"seq1": [1, 2, 3, 4, 5], "seq2": [1, 6, 5, 7, 8, 9, 10], "seq3": [1, 12, 13]}
    for req_id, prompt in prompts.items():
        scheduler.add_request(Request(req_id, prompt, greedy()))
    so = scheduler.schedule()
    tables = {r.req_id: r.block_ids[0] for r in so.scheduled_new_reqs}  # one KV-cache group
    assert tables == {"seq1": [0, 1], "seq2": [2, 3], "seq3": [4]}
    assert so.num_scheduled_tokens == {"seq1": 5, "seq2": 7, "seq3": 3} and so.total_num_scheduled_tokens == 15
    slots = []
    for r in so.scheduled_new_reqs:
        slots += compute_slot_mapping(r.block_ids[0], r.num_computed_tokens, so.num_scheduled_tokens[r.req_id], 4)
    assert slots == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18]

    scheduler.update_from_output(so, sample(scheduler, so, {"seq1": [14], "seq2": [15], "seq3": [16]}))
    so = scheduler.schedule()  # decode: one token each at positions 5, 7, 3
    assert not so.scheduled_new_reqs
    cached = {r.req_id: r for r in so.scheduled_cached_reqs}
    assert {k: (c.num_computed_tokens, c.new_block_ids) for k, c in cached.items()} == {
        "seq1": (5, ([],)),
        "seq2": (7, ([],)),
        "seq3": (3, ([],)),
    }
    decode_slots = [compute_slot_mapping(tables[k], cached[k].num_computed_tokens, 1, 4)[0] for k in prompts]
    assert decode_slots == [5, 15, 19]


# ----------------------------------------------------------------- budgets and chunking


def test_running_requests_first_then_waiting_in_one_mixed_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(Request("a", [1, 2, 3], greedy()))
    step(scheduler)
    scheduler.add_request(Request("b", list(range(20)), greedy()))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}  # a's decode, then b's first chunk
    assert [r.req_id for r in so.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(Request("a", list(range(20)), greedy()))
    chunks, outputs = [], []
    for _ in range(3):
        so, out = step(scheduler)
        chunks.append(so.num_scheduled_tokens["a"])
        outputs.append(by_id(out).get("a"))
    assert chunks == [8, 8, 4]
    assert outputs[0] is None and outputs[1] is None
    assert outputs[2].new_token_ids == [7]
    cached = scheduler.schedule().scheduled_cached_reqs[0]
    assert cached.num_computed_tokens == 20


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    scheduler.add_request(Request("a", list(range(14)), greedy()))
    scheduler.add_request(Request("b", list(range(100, 104)), greedy()))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 6, "b": 1}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    scheduler = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    scheduler.add_request(Request("a", list(range(40)), greedy()))
    scheduler.add_request(Request("b", list(range(100, 130)), greedy()))  # 30 > 24 left
    scheduler.add_request(Request("c", [1], greedy()))  # FCFS: waits behind b
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30, "c": 1}


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [i + 1, 2], greedy(2)))
    so, _ = step(scheduler)
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1"] and len(scheduler.running) == 2
    so, out = step(scheduler)  # r0, r1 finish (max_tokens=2)
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1"]
    assert all(o.finish_reason == FinishReason.LENGTH for o in out.outputs)
    so, _ = step(scheduler)
    assert sorted(so.num_scheduled_tokens) == ["r2"]
    assert so.finished_req_ids == {"r0", "r1"}


# ----------------------------------------------------------------- preemption


def test_fcfs_preempts_the_latest_running_request_and_resumes_it() -> None:
    # 4 blocks of 2: a (3 tokens, 2 blocks) and b (3 tokens, 2 blocks) fill the cache.
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    scheduler.add_request(Request("a", [1, 2, 3], greedy(8)))
    scheduler.add_request(Request("b", [4, 5, 6], greedy(8)))
    step(scheduler, {"a": [10], "b": [20]})
    # Both decode at position 3 (fits their 2nd block); then position 4 needs a 3rd block.
    step(scheduler, {"a": [11], "b": [21]})
    so, out = step(scheduler, {"a": [12]})
    assert list(so.num_scheduled_tokens) == ["a"]
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [20, 21] and b.num_preemptions == 1
    assert scheduler.waiting.peek() is b
    assert [e.type for e in b.events][-1] == EngineCoreEventType.PREEMPTED
    assert out.scheduler_stats.num_preemptions == 1
    assert so.finished_req_ids == {"b"}  # the worker drops b's state in this very step
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["a"]  # b waits: a holds 3 of the 4 blocks

    # Once a finishes, b comes back as a new request with its outputs, recomputing all.
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    so = scheduler.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    resumed = so.scheduled_new_reqs[0]
    assert resumed.prompt_token_ids == [4, 5, 6] and resumed.output_token_ids == [20, 21]
    assert resumed.num_computed_tokens + so.num_scheduled_tokens["b"] == 5
    # b's freed blocks went to the free queue last-first: a took the second one (LRU
    # head), the first is still cached and is a prefix-cache hit.
    assert resumed.num_computed_tokens == 2 and resumed.block_ids[0][0] == 2
    assert [e.type for e in b.events][-1] == EngineCoreEventType.SCHEDULED


def test_a_request_preempts_itself_when_it_is_the_latest() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=2)
    scheduler.add_request(Request("a", [1], greedy(8)))
    scheduler.add_request(Request("b", [4, 5, 6], greedy(8)))
    step(scheduler, {"a": [10], "b": [20]})
    step(scheduler, {"a": [11], "b": [21]})
    so, _ = step(scheduler)  # b (latest) needs a 3rd block: it is the one preempted
    assert list(so.num_scheduled_tokens) == ["a"] and so.finished_req_ids == {"b"}
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["a"].status == RequestStatus.RUNNING


def test_priority_preemption_undoes_a_victim_scheduled_earlier_in_the_step() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=2, policy="priority", long_prefill_token_threshold=4)
    runner = FakeModelRunner(8, 2)
    tokens: dict[str, list[int]] = {"low": [], "high": []}

    def run(so: SchedulerOutput) -> None:
        for o in scheduler.update_from_output(so, runner.execute_model(so)).outputs:
            tokens[o.request_id] += o.new_token_ids

    low = Request("low", list(range(1, 13)), greedy(3), priority=5, arrival_time=1.0)
    scheduler.add_request(low)
    run(scheduler.schedule())  # low: positions 0..3 (blocks 0, 1)
    high = Request("high", [4, 5, 6, 7], greedy(3), priority=0, arrival_time=2.0)
    scheduler.add_request(high)
    run(scheduler.schedule())  # low: 4..7 (blocks 2, 3); high: its prompt (blocks 4, 5)
    # low is first in running and takes the last 2 blocks for 8..11; high's decode then
    # finds no block and preempts low (largest priority value), undoing low's step.
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"high": 1} and so.total_num_scheduled_tokens == 1
    assert [r.req_id for r in so.scheduled_cached_reqs] == ["high"] and "low" in so.finished_req_ids
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(low.block_hashes[3]) is not None  # computed in the last step
    # Blocks cached for 8..11 when low was scheduled never got their KV: not hits later.
    assert pool.get_cached_block(low.block_hashes[4]) is None
    assert pool.get_cached_block(low.block_hashes[5]) is None
    run(so)
    while scheduler.has_requests():
        run(scheduler.schedule())
    for request in (low, high):
        assert tokens[request.request_id] == reference_generate(request.prompt_token_ids, greedy(3), None, 64)[0]


def test_a_request_larger_than_the_whole_cache_finishes_instead_of_deadlocking() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, max_model_len=16)
    scheduler.add_request(Request("a", [1, 2, 3], greedy(10)))
    outputs = []
    for _ in range(5):
        _, out = step(scheduler)
        outputs += out.outputs
    assert not scheduler.has_unfinished_requests()
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and final[0].finish_reason == FinishReason.LENGTH
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 2

    scheduler = make_scheduler(num_blocks=2, block_size=2, max_model_len=16)
    scheduler.add_request(Request("b", list(range(6)), greedy(10)))  # the prompt alone is too big
    so, out = step(scheduler)
    assert so.total_num_scheduled_tokens == 0
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("b", FinishReason.LENGTH)]


# ----------------------------------------------------------------- aborts


def test_abort_in_every_state() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    scheduler.add_request(Request("run", [1, 2, 3], greedy()))
    scheduler.add_request(Request("run2", [4, 5], greedy()))
    scheduler.add_request(Request("wait", [6], greedy()))
    step(scheduler)
    assert scheduler.requests["wait"].status == RequestStatus.WAITING
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_unfinished_requests() == 1
    assert len(scheduler.kv_cache_manager.req_to_blocks) == 1
    so, out = step(scheduler)
    assert {"run", "wait"} <= so.finished_req_ids
    aborted = by_id(out)
    assert aborted["run"].finish_reason == FinishReason.ABORT and aborted["run"].new_token_ids == []
    assert aborted["wait"].finish_reason == FinishReason.ABORT
    assert {"run", "wait"} <= out.finished_requests
    # Aborting again (already finished) produces nothing.
    scheduler.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    _, out = step(scheduler)
    assert "run" not in by_id(out)


def test_abort_of_a_preempted_request_and_stop_string_finish() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    scheduler.add_request(Request("a", [1, 2, 3], greedy()))
    scheduler.add_request(Request("b", [4, 5, 6], greedy()))
    step(scheduler)
    step(scheduler)
    step(scheduler)  # b is preempted (see the FCFS test)
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.waiting) == 0
    # The detokenizer found a stop string: finished, but no output from the core.
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()
    so, out = step(scheduler)
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("b", FinishReason.ABORT)]
    assert so.finished_req_ids == {"a", "b"}
    assert scheduler.kv_cache_manager.usage == 0.0
    assert not scheduler.has_requests()


def test_finish_requests_needs_a_finished_status() -> None:
    with pytest.raises(ValueError, match="FINISHED_"):
        make_scheduler().finish_requests("x", RequestStatus.RUNNING)


# ----------------------------------------------------------------- stop conditions


def finish_of(scheduler: Scheduler, tokens: list[int]) -> tuple[list[int], object, object]:
    """Feed ``tokens`` one per step to request "r"; (outputs so far, finish reason, stop reason)."""
    got = []
    for token in tokens:
        _, out = step(scheduler, {"r": [token]})
        o = by_id(out).get("r")
        if o is None:
            continue
        got += o.new_token_ids
        if o.finished:
            return got, o.finish_reason, o.stop_reason
    return got, None, None


def test_eos_stops_unless_ignored() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("r", [1, 2], greedy(), eos_token_id=2))
    assert finish_of(scheduler, [5, 2, 6]) == ([5, 2], FinishReason.STOP, None)
    scheduler.add_request(Request("r", [1, 2], greedy(3, ignore_eos=True), eos_token_id=2))
    assert finish_of(scheduler, [2, 2, 2, 2]) == ([2, 2, 2], FinishReason.LENGTH, None)


def test_stop_token_ids_report_the_token_and_min_tokens_delays_stops() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("r", [1], greedy(stop_token_ids=[9, 8])))
    assert finish_of(scheduler, [5, 8, 9]) == ([5, 8], FinishReason.STOP, 8)
    scheduler.add_request(Request("r", [1], greedy(min_tokens=3, stop_token_ids=[9]), eos_token_id=4))
    assert finish_of(scheduler, [9, 4, 9, 4]) == ([9, 4, 9], FinishReason.STOP, 9)


def test_max_tokens_and_max_model_len_cap_the_length() -> None:
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(Request("r", [1, 2], greedy(3)))
    assert finish_of(scheduler, [5, 6, 7, 8]) == ([5, 6, 7], FinishReason.LENGTH, None)
    scheduler.add_request(Request("r", [1, 2, 3], greedy(None)))  # None: up to max_model_len
    assert finish_of(scheduler, list(range(10, 20))) == ([10, 11, 12, 13, 14], FinishReason.LENGTH, None)
    scheduler.add_request(Request("r", list(range(8)), greedy(5)))  # prompt == max_model_len
    assert finish_of(scheduler, [5, 6]) == ([5], FinishReason.LENGTH, None)


def test_draft_tokens_are_scheduled_and_rejected_ones_recomputed() -> None:
    scheduler = make_scheduler(block_size=4, speculative=speculative_config(3))
    request = Request("r", [1, 2, 3], greedy(10, stop_token_ids=[99]))
    scheduler.add_request(request)
    step(scheduler, {"r": [4]})
    request.spec_token_ids = [5, 6, 7]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_spec_decode_tokens == {"r": [5, 6, 7]}
    assert scheduler.kv_cache_manager.get_block_ids("r") == ([0, 1],)  # slots for positions 3..6
    # The runner accepted 5 and 6, rejected 7, and sampled 8 instead.
    out = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[5, 6, 8]]))
    assert by_id(out)["r"].new_token_ids == [5, 6, 8]
    assert request.num_computed_tokens == 6 and request.num_tokens == 7 and request.spec_token_ids == []
    so = scheduler.schedule()
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 6 and so.num_scheduled_tokens == {"r": 1}
    scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[9]]))
    # A stop token inside the accepted tokens drops the rest.
    request.spec_token_ids = [99, 11]
    so = scheduler.schedule()
    out = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[99, 11, 12]]))
    o = by_id(out)["r"]
    assert o.new_token_ids == [99] and o.finish_reason == FinishReason.STOP and o.stop_reason == 99
    assert request.output_token_ids == [4, 5, 6, 8, 9, 99]


def test_draft_tokens_are_trimmed_to_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3, max_num_seqs=1, speculative=speculative_config(4))
    request = Request("r", [1], greedy())
    scheduler.add_request(request)
    step(scheduler)
    request.spec_token_ids = [5, 6, 7, 8]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 3} and so.scheduled_spec_decode_tokens == {"r": [5, 6]}


def test_draft_tokens_never_reach_past_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=8, speculative=speculative_config(3))
    request = Request("r", list(range(6)), greedy())
    scheduler.add_request(request)
    step(scheduler)  # 7 tokens, 6 computed: positions 6 and 7 are left
    request.spec_token_ids = [5, 6, 7]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 2} and so.scheduled_spec_decode_tokens == {"r": [5]}


def test_pooling_request_finishes_with_its_vector_after_a_chunked_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(Request("p", list(range(10)), None, pooling_params=PoolingParams()))
    for expected in (4, 4):
        so = scheduler.schedule()
        assert so.num_scheduled_tokens == {"p": expected}
        out = scheduler.update_from_output(so, ModelRunnerOutput(["p"], [[]], pooler_output=[None]))
        assert out.outputs == []
    so = scheduler.schedule()
    vector = torch.tensor([0.5, 0.25])
    out = scheduler.update_from_output(so, ModelRunnerOutput(["p"], [[]], pooler_output=[vector]))
    o = by_id(out)["p"]
    assert o.finish_reason == FinishReason.STOP and o.pooling_output is vector and o.new_token_ids == []
    assert not scheduler.has_unfinished_requests()


def test_missing_runner_results_are_an_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("r", [1], greedy()))
    so = scheduler.schedule()
    with pytest.raises(RuntimeError, match=r"no result for scheduled requests \['r'\]"):
        scheduler.update_from_output(so, ModelRunnerOutput([], []))


# ----------------------------------------------------------------- events and stats


def test_events_timestamps_and_stats() -> None:
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=1)
    t0 = time.monotonic()
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5], greedy(2)))
    scheduler.add_request(Request("b", [1, 2, 3, 4, 9], greedy(2)))
    so, out = step(scheduler)
    t1 = time.monotonic()
    o = by_id(out)["a"]
    assert [e.type for e in o.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert t0 <= o.events[0].timestamp <= o.events[1].timestamp <= out.timestamp <= t1
    stats = out.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 10)
    assert (stats.prefix_cache_stats.requests, stats.prefix_cache_stats.queries) == (1, 5)
    _, out = step(scheduler)  # a finishes: no new events
    assert by_id(out)["a"].events is None and by_id(out)["a"].finished
    _, out = step(scheduler)  # b: hits a's first block
    o = by_id(out)["b"]
    assert [e.type for e in o.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert o.num_cached_tokens == 4
    assert (out.scheduler_stats.prefix_cache_stats.queries, out.scheduler_stats.prefix_cache_stats.hits) == (5, 4)


def test_without_log_stats_no_events_and_no_stats() -> None:
    sc, cc = make_configs()
    scheduler = Scheduler(sc, cc, num_blocks=16, log_stats=False)
    scheduler.add_request(Request("a", [1, 2], greedy(1)))
    _, out = step(scheduler)
    assert out.scheduler_stats is None and out.outputs[0].events is None
    assert scheduler.make_stats().num_running_reqs == 0


def test_fcfs_and_priority_order_the_waiting_queue() -> None:
    for policy, expected in (("fcfs", ["x", "y", "z"]), ("priority", ["z", "y", "x"])):
        scheduler = make_scheduler(policy=policy, max_num_seqs=1)
        for i, (req_id, priority) in enumerate((("x", 2), ("y", 1), ("z", 1))):
            scheduler.add_request(Request(req_id, [1], greedy(1), priority=priority, arrival_time=float(3 - i)))
        order = []
        while scheduler.has_unfinished_requests():
            so, _ = step(scheduler)
            order += [r.req_id for r in so.scheduled_new_reqs]
        assert order == expected, policy


def test_end_to_end_with_the_fake_model() -> None:
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = {f"r{i}": [i, i + 1, i + 2] * (i + 1) for i in range(6)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(Request(req_id, prompt, greedy(9)))
    got = run_to_completion(scheduler, FakeModelRunner(12, 4))
    for req_id, prompt in prompts.items():
        assert got[req_id] == reference_generate(prompt, greedy(9), None, 64)[0]
