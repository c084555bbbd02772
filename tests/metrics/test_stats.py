"""Front-end stats from engine-core events, driven through the OutputProcessor with
hand-made timestamps (engine core: monotonic seconds; front end: wall clock)."""

from __future__ import annotations

import pytest

from kvloom.engine.output_processor import OutputProcessor
from kvloom.metrics.stats import IterationStats
from kvloom.outputs import EngineCoreOutput
from kvloom.request import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from kvloom.sampling_params import RequestOutputKind, SamplingParams

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED
ARRIVAL = 1000.0  # front-end wall clock
PROMPT = [11, 12, 13, 14]


def ev(kind, ts):
    return EngineCoreEvent(kind, ts)


class Driver:
    """Feeds one request's outputs step by step and keeps every step's IterationStats."""

    def __init__(self, max_tokens=16):
        self.op = OutputProcessor(None)
        req = EngineCoreRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY),
                                arrival_time=ARRIVAL)
        self.op.add_request(req, None)
        self.steps: list[IterationStats] = []

    def step(self, core_ts, wall_ts, tokens, events=None, finish=None):
        stats = IterationStats(iteration_timestamp=wall_ts)
        out = EngineCoreOutput("r", tokens, events=events, finish_reason=finish)
        self.op.process_outputs([out], engine_core_timestamp=core_ts, iteration_stats=stats)
        self.steps.append(stats)
        return stats

    def all(self, name):
        return [x for s in self.steps for x in getattr(s, name)]

    @property
    def finished(self):
        (f,) = self.all("finished_requests")
        return f


def test_common_case_intervals():
    d = Driver()
    first = d.step(15.0, 1003.0, [1], events=[ev(Q, 10.0), ev(S, 12.0)])
    assert first.num_prompt_tokens == len(PROMPT) and first.num_generation_tokens == 1
    assert first.time_to_first_tokens_iter == [pytest.approx(3.0)]  # wall clock, from arrival
    assert first.queue_times_iter == [pytest.approx(2.0)] and first.prefill_times_iter == [pytest.approx(3.0)]
    assert first.inter_token_latencies_iter == []
    second = d.step(16.0, 1004.0, [2])
    assert second.num_prompt_tokens == 0 and second.inter_token_latencies_iter == [pytest.approx(1.0)]
    last = d.step(18.0, 1006.5, [3], finish=FinishReason.LENGTH)
    assert last.inter_token_latencies_iter == [pytest.approx(2.0)]
    f = d.finished
    assert f.finish_reason == FinishReason.LENGTH
    assert f.e2e_latency == pytest.approx(6.5)
    assert f.queued_time == pytest.approx(2.0)  # QUEUED 10 -> SCHEDULED 12
    assert f.prefill_time == pytest.approx(3.0)  # SCHEDULED 12 -> first token 15
    assert f.decode_time == pytest.approx(3.0)  # first token 15 -> last token 18
    assert f.inference_time == pytest.approx(6.0)  # SCHEDULED 12 -> last token 18
    assert f.mean_time_per_output_token == pytest.approx(1.5)
    assert f.num_prompt_tokens == 4 and f.num_generation_tokens == 3 and f.max_tokens_param == 16
    assert d.all("n_params_iter") == [1] and d.all("max_num_generation_tokens_iter") == [3]
    assert sum(s.num_preempted_reqs for s in d.steps) == 0


def test_preemption_during_decode_lengthens_itl_decode_and_inference():
    d = Driver()
    d.step(15.0, 1003.0, [1], events=[ev(Q, 10.0), ev(S, 12.0)])
    d.step(16.0, 1004.0, [2])
    # preempted at 17, rescheduled at 20 (recomputes), next token at 25
    resumed = d.step(25.0, 1013.0, [3], events=[ev(P, 17.0), ev(S, 20.0)], finish=FinishReason.LENGTH)
    assert resumed.num_preempted_reqs == 1
    assert resumed.inter_token_latencies_iter == [pytest.approx(9.0)]
    assert resumed.num_prompt_tokens == 0 and resumed.time_to_first_tokens_iter == []  # not a new prefill
    assert resumed.queue_times_iter == []  # only the first scheduling counts
    f = d.finished
    assert f.queued_time == pytest.approx(2.0)
    assert f.prefill_time == pytest.approx(3.0)
    assert f.decode_time == pytest.approx(10.0)  # 15 -> 25, preemption included
    assert f.inference_time == pytest.approx(13.0)  # 12 -> 25


def test_preemption_during_prefill_lengthens_ttft_and_prefill():
    d = Driver()
    first = d.step(18.0, 1009.0, [1], events=[ev(Q, 10.0), ev(S, 12.0), ev(P, 13.0), ev(S, 14.0)])
    assert first.num_preempted_reqs == 1
    assert first.time_to_first_tokens_iter == [pytest.approx(9.0)]
    assert first.queue_times_iter == [pytest.approx(2.0)]
    assert first.prefill_times_iter == [pytest.approx(6.0)]  # first SCHEDULED 12 -> first token 18
    d.step(19.0, 1010.0, [2], finish=FinishReason.STOP)
    f = d.finished
    assert f.queued_time == pytest.approx(2.0) and f.prefill_time == pytest.approx(6.0)
    assert f.decode_time == pytest.approx(1.0) and f.inference_time == pytest.approx(7.0)


def test_multi_token_steps_count_tokens():
    d = Driver()
    s = d.step(15.0, 1003.0, [1, 2, 3], events=[ev(Q, 10.0), ev(S, 12.0)])
    assert s.num_generation_tokens == 3
    d.step(16.0, 1004.0, [4, 5], finish=FinishReason.LENGTH)
    assert d.finished.num_generation_tokens == 5
    assert d.finished.mean_time_per_output_token == pytest.approx(1.0 / 4)


def test_abort_while_waiting_has_zero_intervals():
    d = Driver()
    d.step(11.0, 1001.0, [], events=[ev(Q, 10.0)], finish=FinishReason.ABORT)
    f = d.finished
    assert f.finish_reason == FinishReason.ABORT and f.num_generation_tokens == 0
    assert (f.queued_time, f.prefill_time, f.decode_time, f.inference_time) == (0.0, 0.0, 0.0, 0.0)
    assert f.e2e_latency == pytest.approx(1.0)
    assert d.all("time_to_first_tokens_iter") == [] and d.steps[0].num_prompt_tokens == 0


def test_stats_of_several_requests_in_one_step():
    op = OutputProcessor(None)
    for rid, arrival in (("a", 100.0), ("b", 101.0)):
        op.add_request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(), arrival_time=arrival), None)
    stats = IterationStats(iteration_timestamp=104.0)
    op.process_outputs(
        [EngineCoreOutput("a", [7], events=[ev(Q, 1.0), ev(S, 1.5)]), EngineCoreOutput("b", [8], events=[ev(Q, 2.0), ev(S, 3.0)])],
        engine_core_timestamp=4.0,
        iteration_stats=stats,
    )
    assert stats.num_prompt_tokens == 6 and stats.num_generation_tokens == 2
    assert stats.time_to_first_tokens_iter == [pytest.approx(4.0), pytest.approx(3.0)]
    assert stats.queue_times_iter == [pytest.approx(0.5), pytest.approx(1.0)]
    assert stats.prefill_times_iter == [pytest.approx(2.5), pytest.approx(1.0)]
