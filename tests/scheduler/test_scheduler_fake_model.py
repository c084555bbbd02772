"""The fake model runner (``tests.helpers.fake_model``) catches the bugs it exists for."""

from __future__ import annotations

import pytest

from kvloom.sampling_params import SamplingParams
from kvloom.request import Request
from kvloom.scheduler.scheduler import Scheduler
from tests.helpers.fake_model import FakeModelRunner, make_configs, reference_generate, run_to_completion


# ----------------------------------------------------------------- the fake catches bugs


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_fake_runner_matches_reference_for_one_request() -> None:
    sc, cc = make_configs()
    scheduler = Scheduler(sc, cc, num_blocks=32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    scheduler.add_request(Request("a", prompt, _greedy(12)))
    got = run_to_completion(scheduler, FakeModelRunner(32, 4))
    assert got["a"] == reference_generate(prompt, _greedy(12), None, 64)[0]


def test_fake_runner_detects_a_stale_prefix_cache_hit() -> None:
    """Corrupt a cached block's KV: a later request that hits it must go wrong."""
    sc, cc = make_configs()
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    prompt = list(range(1, 13))
    scheduler.add_request(Request("a", prompt, _greedy(2)))
    run_to_completion(scheduler, runner)
    runner.kv[0] = 999  # block 0 slot 0: the first block of "a", still cached
    scheduler.add_request(Request("b", prompt, _greedy(4)))
    got = run_to_completion(scheduler, runner)
    assert got["b"] != reference_generate(prompt, _greedy(4), None, 64)[0]


def test_fake_runner_rejects_wrong_computed_counts() -> None:
    sc, cc = make_configs()
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    scheduler.add_request(Request("a", [1, 2, 3], _greedy(5)))
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute_model(so))
    scheduler.requests["a"].num_computed_tokens += 1  # a scheduler bookkeeping bug
    so = scheduler.schedule()
    with pytest.raises(AssertionError):
        runner.execute_model(so)
