"""Block pool, free queue, block hashing, KVCacheManager allocation and slot mapping."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import cbor2
import pytest

from kvloom.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager
from tests.helpers.fake_model import compute_slot_mapping
from kvloom.kv_cache.hashing import get_hash_function, hash_block_tokens, update_block_hashes
from kvloom.lora.request import LoRARequest
from kvloom.request import Request
from kvloom.sampling_params import PoolingParams, SamplingParams


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def only(per_group: tuple[list[KVCacheBlock], ...]) -> list[KVCacheBlock]:
    """The blocks of a one-group KVCacheManager's per-group tuple."""
    assert len(per_group) == 1
    return per_group[0]


def make_request(req_id: str, prompt: list[int], **kwargs) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=16), **kwargs)


# ----------------------------------------------------------------- free queue


def test_free_queue_pops_in_order_and_removes_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    queue.remove(blocks[3])
    queue.remove(blocks[0])
    queue.remove(blocks[5])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    queue.append(blocks[3])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 3, 0]
    assert queue.popleft().block_id == 1
    assert ids(queue.popleft_n(3)) == [2, 4, 3]
    assert ids(queue.get_all_free_blocks()) == [0] and queue.num_free_blocks == 1
    assert queue.popleft().block_id == 0
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    with pytest.raises(ValueError, match="only 0 are free"):
        queue.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])


def test_free_queue_links_are_consistent_both_ways() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    forward = queue.get_all_free_blocks()
    backward = []
    block = queue._tail.prev_free_block
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free_block
    assert ids(forward) == [0, 1, 3, 4, 2] and backward[::-1] == forward


# ----------------------------------------------------------------- block pool


def test_block_pool_allocates_every_block_once_and_evicts_on_reuse() -> None:
    pool = BlockPool(4)
    assert all(isinstance(b, KVCacheBlock) for b in pool.blocks)
    got = pool.get_new_blocks(2)
    assert ids(got) == [0, 1] and [b.ref_cnt for b in got] == [1, 1]
    pool.cache_full_blocks(got, [b"h0", b"h1"], 0, 2)
    assert pool.get_cached_block(b"h1") is got[1]
    assert pool.get_usage() == 0.5
    pool.free_blocks(reversed(got))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1, 0]
    assert pool.get_cached_block(b"h0") is got[0]  # free but still cached
    pool.touch([got[0]])  # a cache hit on a free block
    assert got[0].ref_cnt == 1 and ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 1]
    assert pool.get_cached_block(b"h1") is None and got[1].block_hash is None  # evicted
    assert pool.get_cached_block(b"h0") is got[0]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_reset_prefix_cache_only_when_nothing_is_used() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"x"], 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is None and blocks[0].block_hash is None


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(3, reserve_null_block=True)
    assert pool.null_block is pool.blocks[0] and pool.num_usable_blocks == 2
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.get_usage() == 1.0


# ----------------------------------------------------------------- hashing


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_block_hashes_are_chained(algo: str) -> None:
    fn = get_hash_function(algo)
    a = make_request("a", list(range(12)))
    b = make_request("b", [99] + list(range(1, 12)))  # differs in the first token only
    ha = update_block_hashes(a, 4, fn)
    hb = update_block_hashes(b, 4, fn)
    assert len(ha) == 3 and len(set(ha)) == 3
    assert all(x != y for x, y in zip(ha, hb))  # the difference propagates down the chain
    # The same tokens at another position (another parent) hash differently.
    c = make_request("c", list(range(4, 8)) + list(range(4, 8)))
    hc = update_block_hashes(c, 4, fn)
    assert hc[0] != ha[1] and hc[1] != hc[0]
    assert hc[0] == hash_block_tokens(fn, None, [4, 5, 6, 7])


def test_known_hash_encodings() -> None:
    """sha256 hashes the pickle, sha256_cbor the canonical CBOR, xxhash is 128-bit."""
    key = (None, (1, 2, 3, 4), None)
    assert get_hash_function("sha256")(key) == hashlib.sha256(pickle.dumps(key, protocol=5)).digest()
    assert get_hash_function("sha256_cbor")(key) == hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
    assert len(get_hash_function("xxhash")(key)) == 16


def test_hashes_grow_incrementally_with_output_tokens() -> None:
    fn = get_hash_function("sha256")
    r = make_request("a", list(range(6)))
    assert len(update_block_hashes(r, 4, fn)) == 1
    first = r.block_hashes[0]
    r.append_output_token_ids([6, 7])
    assert len(update_block_hashes(r, 4, fn)) == 2 and r.block_hashes[0] is first
    fresh = make_request("b", list(range(8)))
    assert update_block_hashes(fresh, 4, fn) == r.block_hashes


def test_lora_and_cache_salt_isolate_the_first_block_and_the_chain() -> None:
    fn = get_hash_function("sha256")
    prompt = list(range(8))
    lora = LoRARequest("adapter", 1, "/tmp/adapter")
    plain = update_block_hashes(make_request("a", prompt), 4, fn)
    salted = update_block_hashes(make_request("b", prompt, cache_salt="tenant-1"), 4, fn)
    salted2 = update_block_hashes(make_request("c", prompt, cache_salt="tenant-2"), 4, fn)
    with_lora = update_block_hashes(make_request("d", prompt, lora_request=lora), 4, fn)
    same_salt = update_block_hashes(make_request("e", prompt, cache_salt="tenant-1"), 4, fn)
    for other in (salted, salted2, with_lora):
        assert other[0] != plain[0] and other[1] != plain[1]
    assert salted[0] != salted2[0] and salted == same_salt
    assert with_lora[0] == hash_block_tokens(fn, None, prompt[:4], (1, None))


def test_unknown_hash_algo_names_the_choices() -> None:
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash"):
        get_hash_function("md5")


_HASH_IN_CHILD = """
from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams
for algo in ("sha256", "sha256_cbor", "xxhash"):
    r = Request("x", list(range(20)), SamplingParams(), cache_salt="s")
    print(",".join(h.hex() for h in update_block_hashes(r, 4, get_hash_function(algo))))
"""


def test_hashes_are_reproducible_across_processes() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    child = subprocess.run([sys.executable, "-c", _HASH_IN_CHILD], env=env, capture_output=True, text=True, check=True)
    here = []
    for algo in ("sha256", "sha256_cbor", "xxhash"):
        r = Request("x", list(range(20)), SamplingParams(), cache_salt="s")
        here.append(",".join(h.hex() for h in update_block_hashes(r, 4, get_hash_function(algo))))
    assert child.stdout.split() == here


# ----------------------------------------------------------------- KVCacheManager


def test_allocate_slots_grows_the_block_table_on_demand() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = make_request("a", list(range(5)))
    assert ids(only(kv.allocate_slots(r, 5))) == [0, 1]
    r.num_computed_tokens = 5
    r.append_output_token_ids(5)
    assert kv.allocate_slots(r, 1) == ([],)  # position 5 fits block 1
    r.num_computed_tokens = 6
    r.append_output_token_ids([6, 7, 8])
    assert ids(only(kv.allocate_slots(r, 3))) == [2]  # positions 6, 7 in block 1, 8 in a new one
    assert kv.get_block_ids("a") == ([0, 1, 2],)


def test_allocate_slots_refuses_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", list(range(100, 109)))
    assert kv.allocate_slots(b, 9) is None  # needs 3 blocks, 1 free
    assert kv.get_num_free_blocks() == 1 and "b" not in kv.req_to_blocks
    assert kv.usage == pytest.approx(2 / 3)


def test_free_returns_blocks_last_first_and_keeps_them_cached() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    r = make_request("a", list(range(7)))
    kv.allocate_slots(r, 7)
    r.num_computed_tokens = 7
    kv.free(r)
    assert ids(kv.block_pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1, 0]
    assert [b.block_hash is not None for b in kv.block_pool.blocks[:4]] == [True, True, True, False]
    assert kv.usage == 0.0 and not kv.req_to_blocks


def test_blocks_cached_for_tokens_never_computed_are_uncached_on_free() -> None:
    """A request preempted in the step it was scheduled: its new full blocks got no KV."""
    kv = KVCacheManager(num_blocks=6, block_size=2)
    r = make_request("a", list(range(6)))
    kv.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    kv.allocate_slots(r, 2)  # block 2 cached for tokens 4, 5 ...
    assert kv.block_pool.blocks[2].block_hash is not None
    kv.free(r)  # ... but freed before they were computed (num_computed_tokens still 4)
    assert kv.block_pool.blocks[2].block_hash is None
    assert kv.block_pool.blocks[1].block_hash is not None
    again = make_request("b", list(range(6)) + [9])
    blocks, num_hits = kv.get_computed_blocks(again)
    assert ids(only(blocks)) == [0, 1] and num_hits == 4


def test_draft_tokens_get_slots_but_are_not_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    r = make_request("a", [1, 2, 3])
    kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    r.append_output_token_ids(4)
    r.spec_token_ids = [5, 6, 7]
    new = kv.allocate_slots(r, 4)  # token 4 at position 3 plus three drafts
    assert len(kv.get_block_ids("a")[0]) == 4 and len(new[0]) == 2
    cached = [b.block_hash is not None for b in kv.req_to_blocks["a"]]
    assert cached == [True, True, False, False]  # drafts may be rejected


def test_get_computed_blocks_always_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    same = make_request("b", list(range(8)))
    blocks, num_hits = kv.get_computed_blocks(same)
    assert ids(only(blocks)) == [0] and num_hits == 4  # not both blocks: the last token is recomputed
    pooling = Request("p", list(range(8)), None, pooling_params=PoolingParams())
    assert kv.get_computed_blocks(pooling) == (([],), 0)


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == (([],), 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_prefix_cache_stats_are_counted_and_reset() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, log_stats=True)
    kv.record_prefix_cache_query(10, 8)
    kv.record_prefix_cache_query(6, 0)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.reset) == (2, 16, 8, False)
    assert kv.reset_prefix_cache()
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.reset) == (0, 0, 0, True)
    assert KVCacheManager(num_blocks=2, block_size=4).make_prefix_cache_stats() is None


# ----------------------------------------------------------------- slot mapping


def test_compute_slot_mapping_three_prompt_example() -> None:
    """The seed's three prompts (block size 4; vLLM keeps block 0 as the null block)."""
    kv = KVCacheManager(num_blocks=8, block_size=4, reserve_null_block=True)
    prompts = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]
    requests = [make_request(f"seq{i}", p) for i, p in enumerate(prompts)]
    tables = []
    for r in requests:
        kv.allocate_slots(r, r.num_tokens)
        tables.append(kv.get_block_ids(r.request_id)[0])
    assert tables == [[1, 2], [3, 4], [5]]
    slot_mapping = []
    for r, table in zip(requests, tables):
        slot_mapping += compute_slot_mapping(table, 0, r.num_tokens, 4)
    assert slot_mapping == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]

    # Decode: sampled [14, 15, 16] go to positions [5, 7, 3].
    decode_slots = []
    for r, table, token in zip(requests, tables, [14, 15, 16]):
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(token)
        assert kv.allocate_slots(r, 1) == ([],)  # all fit their last block
        decode_slots += compute_slot_mapping(kv.get_block_ids(r.request_id)[0], r.num_computed_tokens, 1, 4)
    assert [r.num_computed_tokens for r in requests] == [5, 7, 3]
    assert decode_slots == [9, 19, 23]


def test_compute_slot_mapping_checks_its_inputs() -> None:
    assert compute_slot_mapping([3, 7], 14, 4, 16) == [62, 63, 112, 113]
    with pytest.raises(ValueError, match="need 3 blocks"):
        compute_slot_mapping([3, 7], 30, 3, 16)
    with pytest.raises(ValueError, match="start_pos"):
        compute_slot_mapping([3], -1, 1, 16)
