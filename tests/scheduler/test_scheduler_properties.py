"""Property tests: random request streams through schedule/update with a fake model.

Random configurations (tiny KV pools that force preemption, small token budgets, chunk
caps, both policies, prefix caching on/off) and random streams (shared prefixes,
arrivals, aborts, stop-string finishes, priorities, draft tokens, pooling requests).
After every call the block pool must be consistent (ref counts equal owners, the free
queue holds exactly the unowned blocks, the prefix-cache map matches the blocks'
hashes) and the step limits must hold; at the end every request has finished exactly
once with the reference model's tokens, and every block is free again.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.helpers.fake_model import (
    VOCAB,
    FakeModelRunner,
    fake_next_token,
    make_configs,
    reference_generate,
    speculative_config,
)

from kvloom.request import Request, RequestStatus
from kvloom.sampling_params import PoolingParams, SamplingParams
from kvloom.scheduler.output import SchedulerOutput
from kvloom.scheduler.scheduler import Scheduler


@dataclass
class ReqSpec:
    arrival_step: int
    prompt: list[int]
    params: SamplingParams | None  # None: a pooling request
    priority: int
    finish_step: int | None  # finish_requests() from outside at this step
    finish_status: RequestStatus
    drafts: bool


@dataclass
class Scenario:
    config: dict
    num_blocks: int
    eos_token_id: int | None
    requests: list[ReqSpec]
    seed: int


@st.composite
def scenarios(draw: st.DrawFn, priority_chunked_stress: bool = False) -> Scenario:
    """``priority_chunked_stress``: priority policy, small prefill chunks and a pool that
    barely fits one request, so low-priority prefills get preempted mid-step a lot."""
    block_size = draw(st.sampled_from([1, 2] if priority_chunked_stress else [1, 2, 4, 8]))
    max_model_len = draw(st.integers(6, 40))
    min_blocks = -(-max_model_len // block_size)  # the engine sizes for one full request
    num_blocks = draw(st.integers(min_blocks, min_blocks + (2 if priority_chunked_stress else 8)))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = priority_chunked_stress or draw(st.booleans())
    if chunked:
        max_batched = draw(st.integers(max_num_seqs, 40))
    else:
        max_batched = draw(st.integers(max_model_len, max_model_len + 24))
    config = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([1, 2, 4] if priority_chunked_stress else [0, 0, 1, 3, 8])),
        enable_chunked_prefill=chunked,
        policy="priority" if priority_chunked_stress else draw(st.sampled_from(["fcfs", "priority"])),
        block_size=block_size,
        enable_prefix_caching=draw(st.booleans()),
        hash_algo=draw(st.sampled_from(["sha256", "sha256_cbor", "xxhash"])),
    )
    tokens = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(tokens, min_size=0, max_size=16), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, min_size=0, max_size=10))
        prompt = (prompt or [draw(tokens)])[:max_model_len]
        if draw(st.integers(0, 9)) == 0:
            params = None
        else:
            max_tokens = draw(st.integers(1, 16))
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                min_tokens=draw(st.integers(0, max_tokens)),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=draw(st.lists(tokens, max_size=2)),
            )
        requests.append(
            ReqSpec(
                arrival_step=draw(st.integers(0, 12)),
                prompt=prompt,
                params=params,
                priority=draw(st.integers(0, 3)),
                finish_step=draw(st.none() | st.integers(0, 30)),
                finish_status=draw(st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])),
                drafts=params is not None and draw(st.booleans()),
            )
        )
    eos = draw(st.sampled_from([None, 0, 5]))
    return Scenario(config, num_blocks, eos, requests, draw(st.integers(0, 2**32 - 1)))


def check_block_pool(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.RUNNING, f"{req_id} holds blocks while {request.status.name}"
        assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
        owners.update(b.block_id for b in blocks)
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    assert len(free) == len(free_ids) == pool.free_block_queue.num_free_blocks
    num_hashed = 0
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"block {block.block_id}: ref_cnt != owners"
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        if block.block_hash is not None:
            num_hashed += 1
            assert pool.cached_block_hash_to_block[block.block_hash][block.block_id] is block
    assert num_hashed == sum(len(d) for d in pool.cached_block_hash_to_block.values())
    for request in scheduler.running:
        assert len(kv.req_to_blocks.get(request.request_id, [])) * kv.block_size >= request.num_computed_tokens


def check_step(scheduler: Scheduler, so: SchedulerOutput, pre_computed: dict[str, int]) -> None:
    cfg = scheduler.scheduler_config
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    ids = [r.req_id for r in so.scheduled_new_reqs] + [r.req_id for r in so.scheduled_cached_reqs]
    assert sorted(ids) == sorted(so.num_scheduled_tokens)
    assert not (set(so.finished_req_ids) & {r.req_id for r in so.scheduled_cached_reqs})
    for req_id, n in so.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        prefill_left = request.num_tokens - pre_computed.get(req_id, 0)
        if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:
            assert n <= cfg.long_prefill_token_threshold
        if not cfg.enable_chunked_prefill and req_id in {r.req_id for r in so.scheduled_new_reqs}:
            assert request.num_computed_tokens == request.num_tokens  # the whole prompt at once
        assert n <= prefill_left + len(so.scheduled_spec_decode_tokens.get(req_id, []))
        assert request.num_computed_tokens <= cfg.max_model_len  # no KV position past the limit


def make_drafts(request: Request, rng: random.Random) -> list[int]:
    history = list(request.all_token_ids)
    drafts = []
    for _ in range(rng.randint(0, 3)):
        token = fake_next_token(history) if rng.random() < 0.7 else rng.randrange(VOCAB)
        drafts.append(token)
        history.append(token)
    return drafts


def run_scenario(sc: Scenario) -> dict[str, Request]:
    sched_cfg, cache_cfg = make_configs(**sc.config)
    # Up to 3 drafts per step (make_drafts); a draft model's lookahead slots in half the runs.
    speculative = speculative_config(3, lookahead=sc.seed % 2 == 1) if any(r.drafts for r in sc.requests) else None
    scheduler = Scheduler(sched_cfg, cache_cfg, num_blocks=sc.num_blocks, speculative_config=speculative)
    runner = FakeModelRunner(sc.num_blocks, cache_cfg.block_size)
    rng = random.Random(sc.seed)
    specs = {f"r{i}": spec for i, spec in enumerate(sc.requests)}
    tokens: dict[str, list[int]] = {rid: [] for rid in specs}
    finals: dict[str, list] = {rid: [] for rid in specs}
    finished_by_call: set[str] = set()
    objects: dict[str, Request] = {}
    pooled: dict[str, float] = {}

    step = 0
    last_arrival = max(s.arrival_step for s in sc.requests)
    while step <= last_arrival or scheduler.has_requests():
        assert step < 3000, "no progress"
        for rid, spec in specs.items():
            if spec.arrival_step == step:
                request = Request(
                    rid,
                    spec.prompt,
                    spec.params,
                    pooling_params=PoolingParams() if spec.params is None else None,
                    eos_token_id=sc.eos_token_id,
                    arrival_time=step + int(rid[1:]) * 1e-3,
                    priority=spec.priority,
                )
                objects[rid] = request
                scheduler.add_request(request)
            if spec.finish_step == step and rid in objects:
                if rid in scheduler.requests:
                    finished_by_call.add(rid)
                scheduler.finish_requests(rid, spec.finish_status)
        check_block_pool(scheduler)
        for request in scheduler.running:
            if specs[request.request_id].drafts and request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = make_drafts(request, rng)

        pre_computed = {rid: r.num_computed_tokens for rid, r in scheduler.requests.items()}
        so = scheduler.schedule()
        check_step(scheduler, so, pre_computed)
        check_block_pool(scheduler)
        out = scheduler.update_from_output(so, runner.execute_model(so))
        check_block_pool(scheduler)
        for o in out.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id].append(o.finish_reason.value)
            if o.pooling_output is not None:
                pooled[o.request_id] = float(o.pooling_output[0])
        step += 1

    max_model_len = sc.config["max_model_len"]
    for rid, spec in specs.items():
        request = objects[rid]
        assert request.is_finished()
        assert tokens[rid] == request.output_token_ids
        if rid in finished_by_call:
            expected_finals = ["abort"] if spec.finish_status == RequestStatus.FINISHED_ABORTED else []
            assert finals[rid] == expected_finals, (rid, finals[rid])
            if spec.params is not None:
                ref, _ = reference_generate(spec.prompt, spec.params, sc.eos_token_id, max_model_len)
                assert tokens[rid] == ref[: len(tokens[rid])]
            continue
        assert len(finals[rid]) == 1, (rid, finals[rid])
        if spec.params is None:
            assert finals[rid] == ["stop"] and tokens[rid] == []
            assert pooled[rid] == float(fake_next_token(spec.prompt))
        else:
            ref, reason = reference_generate(spec.prompt, spec.params, sc.eos_token_id, max_model_len)
            assert tokens[rid] == ref, (rid, tokens[rid], ref)
            assert finals[rid] == [reason]
        assert not request.events  # all were delivered with outputs
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks and kv.usage == 0.0
    assert kv.get_num_free_blocks() == sc.num_blocks
    return objects


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_request_streams(sc: Scenario) -> None:
    run_scenario(sc)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(priority_chunked_stress=True))
def test_random_request_streams_priority_preemption_of_chunked_prefills(sc: Scenario) -> None:
    run_scenario(sc)


def test_a_tiny_pool_preempts_and_results_still_match() -> None:
    """Deterministic instance of the property with guaranteed preemptions."""
    prompt_a = list(range(10))
    specs = [
        ReqSpec(0, prompt_a, SamplingParams(temperature=0.0, max_tokens=12), 0, None, RequestStatus.FINISHED_ABORTED, False),
        ReqSpec(0, prompt_a[:6] + [9, 9], SamplingParams(temperature=0.0, max_tokens=12), 0, None, RequestStatus.FINISHED_ABORTED, True),
        ReqSpec(1, [7, 7, 7], SamplingParams(temperature=0.0, max_tokens=12), 0, None, RequestStatus.FINISHED_ABORTED, False),
    ]
    config = dict(
        max_num_seqs=3, max_num_batched_tokens=16, max_model_len=24, long_prefill_token_threshold=0,
        enable_chunked_prefill=True, policy="fcfs", block_size=4, enable_prefix_caching=True, hash_algo="sha256",
    )
    requests = run_scenario(Scenario(config, num_blocks=7, eos_token_id=None, requests=specs, seed=1))
    assert sum(r.num_preemptions for r in requests.values()) > 0
