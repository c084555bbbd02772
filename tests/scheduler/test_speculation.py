"""The scheduler's side of speculative decoding: the lookahead slots, rejected drafts'
blocks given back (and the runner told), drafts kept only while the request may use
them, prefix-cache hashes over accepted tokens only, the statistics (steps never overlap with speculation: async scheduling is
off, ``config_builder.resolve_async_scheduling``)."""

from __future__ import annotations

from tests.helpers.fake_model import make_configs, speculative_config, step

from kvloom.outputs import ModelRunnerOutput
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.scheduler import Scheduler


def make(k: int = 4, lookahead: bool = False, num_blocks: int = 32, async_scheduling: bool = False,
         **config) -> Scheduler:  # fmt: skip
    sc, cc = make_configs(**{"block_size": 4, **config})
    sc.async_scheduling = async_scheduling
    return Scheduler(sc, cc, num_blocks=num_blocks, speculative_config=speculative_config(k, lookahead))


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_rejected_drafts_give_their_blocks_back_and_the_runner_learns_it() -> None:
    scheduler = make(k=8)
    request = Request("r", [1, 2, 3], greedy())
    scheduler.add_request(request)
    step(scheduler, {"r": [4]})  # 4 tokens, 3 computed: 1 block
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    request.spec_token_ids = [5, 6, 7, 8, 9, 10, 11, 12]
    so = scheduler.schedule()  # positions 3..11: 3 blocks
    assert so.num_scheduled_tokens == {"r": 9}
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 3
    out = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[5, 13]]))  # one accepted, then 13
    assert out.outputs[0].new_token_ids == [5, 13]
    assert request.num_computed_tokens == 5 and request.num_tokens == 6
    # Positions 0..5 need 2 blocks: the third (rejected drafts only) is back in the pool.
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 2
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before - 1
    so = scheduler.schedule()
    assert so.scheduled_cached_reqs[0].num_kept_blocks == 2
    scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[14]]))
    so = scheduler.schedule()
    assert so.scheduled_cached_reqs[0].num_kept_blocks is None  # nothing cut since


def test_a_draft_model_keeps_lookahead_slots() -> None:
    scheduler = make(k=4, lookahead=True)
    request = Request("r", [1, 2, 3], greedy())
    scheduler.add_request(request)
    so = scheduler.schedule()
    # The prompt's 3 slots plus 4 for the drafts the draft model writes after the step.
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 2
    scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[4]], spec_token_ids=[[5, 6, 7, 8]]))
    assert request.spec_token_ids == [5, 6, 7, 8]
    so = scheduler.schedule()  # positions 3..7 computed, drafts' KV up to 7 + 4
    assert so.scheduled_spec_decode_tokens == {"r": [5, 6, 7, 8]}
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 3
    scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[5, 9]], spec_token_ids=[[1, 1, 1, 1]]))
    # 5 computed + 4 lookahead = 9 slots: 3 blocks kept.
    assert len(scheduler.kv_cache_manager.get_block_ids("r")[0]) == 3


def test_drafts_are_cut_to_what_the_request_may_still_emit() -> None:
    scheduler = make(k=4, max_model_len=64)
    request = Request("r", [1, 2, 3], greedy(max_tokens=3))
    scheduler.add_request(request)
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[4]], spec_token_ids=[[5, 6, 7, 8]]))
    # 1 output token; 2 more at most: the next token and one draft.
    assert request.spec_token_ids == [5]


def test_drafts_never_enter_the_prefix_cache() -> None:
    scheduler = make(k=4, enable_prefix_caching=True)
    request = Request("a", [1, 2, 3], greedy(max_tokens=8))
    scheduler.add_request(request)
    step(scheduler, {"a": [4]})
    request.spec_token_ids = [5, 6, 7, 8]  # positions 4..7 fill block 1 with drafts
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput(["a"], [[9]]))  # all rejected
    kv = scheduler.kv_cache_manager
    assert kv.manager.num_cached_blocks["a"] == 1  # only [1, 2, 3, 4]: the drafts were never hashed
    # A request whose prompt is the rejected continuation finds only the first block.
    other = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10], greedy())
    _, hits = kv.get_computed_blocks(other)
    assert hits == 4
    # The accepted continuation is cached once its block fills with known tokens (at the
    # allocation after it filled).
    for token in (10, 11, 12, 13):
        step(scheduler, {"a": [token]})
    same = Request("c", [1, 2, 3, 4, 9, 10, 11, 12, 0], greedy())
    assert kv.get_computed_blocks(same)[1] == 8


def test_statistics_count_drafts_and_acceptances_per_position() -> None:
    scheduler = make(k=3)
    request = Request("r", [1, 2], greedy())
    scheduler.add_request(request)
    step(scheduler, {"r": [3]})
    totals = [0, 0, 0]
    per_pos = [0, 0, 0]
    for drafts, emitted in (([4, 5, 6], [4, 5, 9]), ([7, 8], [7, 8, 1]), ([2], [3])):
        request.spec_token_ids = drafts
        so = scheduler.schedule()
        out = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [emitted]))
        stats = out.scheduler_stats.spec_decoding_stats  # each step's own counts
        assert stats is not None and stats.num_drafts == 1
        totals = [totals[0] + stats.num_drafts, totals[1] + stats.num_draft_tokens,
                  totals[2] + stats.num_accepted_tokens]  # fmt: skip
        per_pos = [a + b for a, b in zip(per_pos, stats.num_accepted_tokens_per_pos)]
    assert totals == [3, 6, 4]
    assert per_pos == [2, 2, 0]
