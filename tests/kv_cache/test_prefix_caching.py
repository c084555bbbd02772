"""The prefix-caching design's worked examples, and prefix caching through the scheduler."""

from __future__ import annotations

from tests.helpers.fake_model import FakeModelRunner, make_configs, reference_generate, run_to_completion

from kvloom.kv_cache import KVCacheManager
from kvloom.kv_cache.block_pool import KVCacheBlock
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.scheduler import Scheduler


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_queue(kv: KVCacheManager) -> list[int]:
    return ids(kv.block_pool.free_block_queue.get_all_free_blocks())


def cached_ids(kv: KVCacheManager) -> set[int]:
    return {b.block_id for b in kv.block_pool.blocks if b.block_hash is not None}


def admit(kv: KVCacheManager, request: Request) -> int:
    """Schedule a new request's whole prompt as the scheduler does; returns the cache hits."""
    computed, num_hits = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hits, computed, num_hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hits


def decode(kv: KVCacheManager, request: Request, token: int) -> None:
    """Append a sampled token and schedule it (one decode step)."""
    request.append_output_token_ids(token)
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def test_ten_block_timeline() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt0 = list(range(100, 115))  # 15 tokens

    # Time 1: an empty cache; 4 blocks, 3 full and cached, the 4th with 3 of 4 tokens.
    req0 = Request("req0", prompt0, SamplingParams())
    assert admit(kv, req0) == 0
    assert kv.get_block_ids("req0") == ([0, 1, 2, 3],)
    assert cached_ids(kv) == {0, 1, 2}

    # Time 2: a decoded token fills block 3 (cached); the next one needs block 4.
    decode(kv, req0, 115)
    assert cached_ids(kv) == {0, 1, 2, 3}
    decode(kv, req0, 116)
    assert kv.get_block_ids("req0") == ([0, 1, 2, 3, 4],)

    # Time 3: 14 prompt tokens, the first 10 shared: only 2 blocks hit (the 3rd matches 2 of 4).
    req1 = Request("req1", prompt0[:10] + [200, 201, 202, 203], SamplingParams())
    assert admit(kv, req1) == 8
    assert kv.get_block_ids("req1") == ([0, 1, 5, 6],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]

    # Time 4: req0 is freed: 2, 3, 4 go to the queue last-first (2 and 3 still cached);
    # 0 and 1 stay with req1.
    kv.free(req0)
    assert free_queue(kv) == [7, 8, 9, 4, 3, 2]
    assert {2, 3} <= cached_ids(kv)

    # Time 5: req1 is freed.
    kv.free(req1)
    assert free_queue(kv) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    # Time 6: 29 tokens, the first 12 shared with req0: hits 0, 1, 2 are taken out of the
    # queue first, then 5 new blocks come from its head, evicting block 3's old content.
    old_hash_of_block_3 = kv.block_pool.blocks[3].block_hash
    req2 = Request("req2", prompt0[:12] + list(range(300, 317)), SamplingParams())
    assert admit(kv, req2) == 12
    assert kv.get_block_ids("req2") == ([0, 1, 2, 7, 8, 9, 4, 3],)
    assert free_queue(kv) == [6, 5]
    assert kv.block_pool.get_cached_block(old_hash_of_block_3) is None


def test_duplicated_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    A, B, C, D, E, F, G, H, I = range(10, 19)

    # Request 1: prompt ABCDEF, decodes G, H, I.
    r1 = Request("r1", [A, B, C, D, E, F], SamplingParams())
    admit(kv, r1)
    decode(kv, r1, G)  # Time 0: [0 (ABCD), 1 (EFG)]
    assert kv.get_block_ids("r1") == ([0, 1],) and cached_ids(kv) == {0}
    decode(kv, r1, H)  # Time 1: [0 (ABCD), 1 (EFGH)]
    assert kv.get_block_ids("r1") == ([0, 1],) and cached_ids(kv) == {0, 1}
    decode(kv, r1, I)  # Time 2: [0 (ABCD), 1 (EFGH), 2 (I)]
    assert kv.get_block_ids("r1") == ([0, 1, 2],) and cached_ids(kv) == {0, 1}
    kv.free(r1)

    # Request 2: the same prompt; only ABCD can hit (the last token is always computed).
    r2 = Request("r2", [A, B, C, D, E, F], SamplingParams())
    assert admit(kv, r2) == 4
    decode(kv, r2, G)  # Time 0: [0 (ABCD), 3 (EFG)]
    assert kv.get_block_ids("r2") == ([0, 3],) and cached_ids(kv) == {0, 1}
    decode(kv, r2, H)  # Time 1: [0 (ABCD), 3 (EFGH)]: block 3 duplicates block 1
    assert kv.get_block_ids("r2") == ([0, 3],)  # append-only: not switched to block 1
    assert cached_ids(kv) == {0, 1, 3}
    efgh = kv.block_pool.blocks[1].block_hash
    assert kv.block_pool.blocks[3].block_hash == efgh
    assert set(kv.block_pool.cached_block_hash_to_block[efgh]) == {1, 3}

    # Once block 1 is evicted, the copy in block 3 still serves hits.
    kv.free(r2)
    queue = free_queue(kv)
    kv.block_pool.touch([kv.block_pool.blocks[i] for i in queue if i not in (1, 3)])
    kv.block_pool.get_new_blocks(1)  # pops the LRU of {1, 3}: block 1 (r1 was freed first)
    assert set(kv.block_pool.cached_block_hash_to_block[efgh]) == {3}
    assert kv.block_pool.get_cached_block(efgh) is kv.block_pool.blocks[3]


# ----------------------------------------------------------------- through the scheduler


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_second_request_reuses_the_shared_prefix_and_stats_count_tokens() -> None:
    sc, cc = make_configs(block_size=4)
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    prefix = list(range(1, 17))  # 4 full blocks
    scheduler.add_request(Request("a", prefix + [20, 21], greedy(3)))
    run_to_completion(scheduler, runner)
    scheduler.make_stats()  # drop the first request's counters

    scheduler.add_request(Request("b", prefix + [30, 31, 32], greedy(3)))
    so = scheduler.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 16 and so.num_scheduled_tokens["b"] == 3
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_stats.requests, stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits) == (
        1,
        19,
        16,
    )
    out = scheduler.update_from_output(so, runner.execute_model(so))
    assert out.outputs[0].num_cached_tokens == 16
    got = run_to_completion(scheduler, runner)
    assert out.outputs[0].new_token_ids + got.get("b", []) == reference_generate(
        prefix + [30, 31, 32], greedy(3), None, 64
    )[0]


def test_requests_in_one_step_share_blocks_cached_in_that_step() -> None:
    """Blocks are cached as soon as allocated: a request admitted later in the same step hits them."""
    sc, cc = make_configs(block_size=4)
    scheduler = Scheduler(sc, cc, num_blocks=32)
    prompt = list(range(1, 13))
    scheduler.add_request(Request("a", prompt, greedy(2)))
    scheduler.add_request(Request("b", prompt + [40], greedy(2)))
    so = scheduler.schedule()
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 12]
    blocks_a, blocks_b = (r.block_ids[0] for r in so.scheduled_new_reqs)
    assert blocks_b[:3] == blocks_a[:3]
    runner = FakeModelRunner(32, 4)
    out = scheduler.update_from_output(so, runner.execute_model(so))
    tokens = {o.request_id: o.new_token_ids for o in out.outputs}
    rest = run_to_completion(scheduler, runner)
    assert tokens["a"] + rest.get("a", []) == reference_generate(prompt, greedy(2), None, 64)[0]
    assert tokens["b"] + rest.get("b", []) == reference_generate(prompt + [40], greedy(2), None, 64)[0]


def test_cache_salt_isolates_tenants() -> None:
    sc, cc = make_configs(block_size=4)
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    prompt = list(range(1, 14))
    scheduler.add_request(Request("a", prompt, greedy(1), cache_salt="alice"))
    run_to_completion(scheduler, runner)
    for req_id, salt, hits in [("b", "bob", 0), ("c", "alice", 12), ("d", None, 0)]:
        scheduler.add_request(Request(req_id, prompt, greedy(1), cache_salt=salt))
        so = scheduler.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == hits, req_id
        scheduler.update_from_output(so, runner.execute_model(so))


def test_reset_prefix_cache_forgets_everything_when_idle() -> None:
    sc, cc = make_configs(block_size=4)
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    prompt = list(range(1, 14))
    scheduler.add_request(Request("a", prompt, greedy(1)))
    so = scheduler.schedule()
    assert not scheduler.reset_prefix_cache()  # "a" holds blocks
    scheduler.update_from_output(so, runner.execute_model(so))  # finishes (max_tokens=1)
    assert scheduler.reset_prefix_cache()
    assert scheduler.make_stats().prefix_cache_stats.reset
    scheduler.add_request(Request("b", prompt, greedy(1)))
    assert scheduler.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_prefix_caching_off_recomputes_everything() -> None:
    sc, cc = make_configs(block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(sc, cc, num_blocks=32)
    runner = FakeModelRunner(32, 4)
    prompt = list(range(1, 14))
    scheduler.add_request(Request("a", prompt, greedy(1)))
    run_to_completion(scheduler, runner)
    scheduler.add_request(Request("b", prompt, greedy(1)))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens["b"] == 13
    stats = scheduler.make_stats().prefix_cache_stats
    assert (stats.queries, stats.hits) == (0, 0)
