"""kvloom-kv-p2p: the two sides of ``P2pNcclConnector`` linked over gloo.

Without a model: a prefill side and a decode side (``kvloom.testing.kv_connector.
KVConnectorHarness``, a KV cache of random data each) in one process. A decode request's
pull lands bit for bit in its own blocks and the prefill side then frees its blocks; a
pull the prefill side refuses (bad ``remote_block_ids``, another KV layout), a prefill side
that is gone, and blocks nobody pulls all end cleanly: failed blocks on the decode side,
freed blocks on the prefill side. (The conformance kit's cases, ``check_kv_connector``,
assume a connector that saves before anyone loads; this one holds blocks until the decode
side pulls them, which the cases here drive.)

Two engines in two processes: a prefill engine (its engine core in a process of its own,
which goes on stepping while it holds blocks for the decode engine) and a decode engine
(in this process). The test does a proxy's job by hand: each prompt goes to the prefill
engine with ``max_tokens`` 1 and ``{"do_remote_decode": true}``, and the
``kv_transfer_params`` it answers go with the prompt to the decode engine. The decode
engine gives exactly one plain engine's greedy tokens and computes only the tail past the
prompt's last full block (counted from its scheduler and its metrics); a pull that fails
fails its request alone (policy ``fail``) or its KV is computed (``recompute``), and the
engine serves the next requests.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from kvloom_kv_p2p import P2pNcclConnector

from kvloom import LLM, SamplingParams
from kvloom.interfaces import KVCacheGroupSpec, KVConnectorRole
from kvloom.testing.kv_connector import KVConnectorHarness, kv_connector_config
from kvloom.testing.models import random_prompts, tiny_model_dir

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def p2p_config(role: str, port: int, **extra: Any) -> dict[str, Any]:
    """The kv_transfer_config of one side of a pair on ``port``."""
    return {"kv_connector": "P2pNcclConnector", "kv_role": role, "kv_rank": 0 if role == "kv_producer" else 1,
            "kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": port,
            "kv_connector_extra_config": {"timeout_s": 5, **extra}}  # fmt: skip


@pytest.fixture
def pair() -> Iterator[tuple[KVConnectorHarness, KVConnectorHarness]]:
    port = free_port()
    producer = KVConnectorHarness(kv_connector_config(p2p_config("kv_producer", port)), seed=0)
    consumer = KVConnectorHarness(kv_connector_config(p2p_config("kv_consumer", port)), seed=1)
    yield producer, consumer
    consumer.shutdown()
    producer.shutdown()


class Stepping:
    """Steps an engine's connector on a thread (as the prefill engine keeps stepping while
    it holds blocks), collecting what it reports sent."""

    def __init__(self, harness: KVConnectorHarness, finished: set[str]) -> None:
        self.harness, self.sent = harness, set[str]()
        self._finished, self._stop = set(finished), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent, _, _ = self.harness.step([], self._finished)
            self._finished = set()
            self.sent |= sent
            time.sleep(0.002)

    def wait_sent(self, request_id: str, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.sent and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self._thread.join()
        return request_id in self.sent


def prefill(producer: KVConnectorHarness, name: str, tokens: list[int], block_ids: list[int]) -> dict[str, Any]:
    """A prefill request with do_remote_decode that computed ``tokens`` into ``block_ids``
    and ended: the kv_transfer_params it answers (its blocks kept)."""
    request = producer.request(name, tokens, {"do_remote_decode": True})
    request.num_computed_tokens = len(tokens)
    keep, params = producer.scheduler.request_finished(request, (block_ids,))
    assert keep and params is not None
    return params


def tokens_of(num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(num_tokens)]


def test_a_pull_lands_bit_for_bit_and_frees_the_prefill_blocks(pair: Any) -> None:
    producer, consumer = pair
    tokens = tokens_of(4 * BLOCK + 5)
    src, dst = [7, 3, 90, 41, 12], [5, 66, 8, 101, 30]
    params = prefill(producer, "p-0", tokens, src)
    assert params["do_remote_prefill"] and params["remote_block_ids"] == src[:4]
    assert params["remote_request_id"] == "p-0" and (params["remote_host"], params["remote_port"]) == \
        ("127.0.0.1", producer.config.kv_transfer.kv_port)  # fmt: skip
    assert consumer.scheduler.validate_kv_transfer_params(params) is None
    stepping = Stepping(producer, {"p-0"})
    before = consumer.blocks_of(dst)
    num_tokens, failed = consumer.load(consumer.request("d-0", tokens, params), dst)
    assert (num_tokens, failed) == (4 * BLOCK, set())
    assert stepping.wait_sent("p-0")
    for want, got, old in zip(producer.blocks_of(src[:4]), consumer.blocks_of(dst), before):
        assert torch.equal(want.view(torch.uint8), got[:4].view(torch.uint8))
        assert torch.equal(got[4:], old[4:])  # the block of the last token is computed, not loaded
    sent, received = producer.worker.get_stats().transfers, consumer.worker.get_stats().transfers
    assert sent["device_to_remote"].blocks == received["remote_to_device"].blocks == 4
    assert received["remote_to_device"].bytes == 4 * sum(c.block_nbytes for c in consumer.layers.values())
    assert consumer.scheduler.take_stats().hits_by_tier == {"remote": 4 * BLOCK}


def test_a_prompt_of_one_block_leaves_its_last_token_to_compute(pair: Any) -> None:
    producer, consumer = pair
    tokens = tokens_of(2 * BLOCK, seed=1)
    params = prefill(producer, "p-1", tokens, [1, 2, 3])
    assert params["remote_block_ids"] == [1, 2]
    stepping = Stepping(producer, {"p-1"})
    assert consumer.load(consumer.request("d-1", tokens, params), [9, 10, 11]) == (BLOCK, set())
    assert stepping.wait_sent("p-1")


def test_bad_remote_block_ids_fail_the_load_and_free_the_prefill_blocks(pair: Any) -> None:
    producer, consumer = pair
    tokens = tokens_of(3 * BLOCK + 1, seed=2)
    params = prefill(producer, "p-2", tokens, [4, 5, 6, 7])
    stepping = Stepping(producer, {"p-2"})
    bad = {**params, "remote_block_ids": [4, 5, 77]}
    assert consumer.load(consumer.request("d-2", tokens, bad), [20, 21, 22, 23]) == (3 * BLOCK, {20, 21, 22})
    assert stepping.wait_sent("p-2")


def test_a_decode_request_of_another_prompt_is_refused(pair: Any) -> None:
    producer, consumer = pair
    tokens = tokens_of(2 * BLOCK + 3, seed=3)
    params = prefill(producer, "p-3", tokens, [1, 2, 3])
    other = consumer.request("d-3", tokens_of(2 * BLOCK + 3, seed=4), params)
    with pytest.raises(ValueError, match="the prompt is not the one the prefill instance computed"):
        consumer.scheduler.get_num_new_matched_tokens(other, 0)


def test_blocks_nobody_pulls_are_freed_after_the_timeout() -> None:
    port = free_port()
    producer = KVConnectorHarness(kv_connector_config(p2p_config("kv_producer", port, abort_request_timeout_s=0.3)))
    try:
        prefill(producer, "p-4", tokens_of(2 * BLOCK), [1, 2])
        start = time.monotonic()
        assert Stepping(producer, {"p-4"}).wait_sent("p-4", timeout_s=5)
        assert time.monotonic() - start >= 0.25
    finally:
        producer.shutdown()


def test_a_prefill_instance_that_is_gone_fails_the_load() -> None:
    consumer = KVConnectorHarness(kv_connector_config(p2p_config("kv_consumer", free_port(), timeout_s=0.5)))
    try:
        tokens = tokens_of(2 * BLOCK + 1, seed=5)
        params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_request_id": "gone",
                  "remote_host": "127.0.0.1", "remote_port": consumer.config.kv_transfer.kv_port}  # fmt: skip
        assert consumer.load(consumer.request("d-5", tokens, params), [3, 4, 5]) == (2 * BLOCK, {3, 4})
    finally:
        consumer.shutdown()


def test_another_kv_layout_is_refused() -> None:
    port = free_port()
    producer = KVConnectorHarness(kv_connector_config(p2p_config("kv_producer", port)))
    consumer = KVConnectorHarness(kv_connector_config(p2p_config("kv_consumer", port), dtype="bfloat16"))
    try:
        tokens = tokens_of(2 * BLOCK + 1, seed=6)
        params = prefill(producer, "p-6", tokens, [1, 2, 3])
        assert "remote_kv_layout: the prefill instance's KV layout" in consumer.scheduler.validate_kv_transfer_params(
            params)  # fmt: skip
        stepping = Stepping(producer, {"p-6"})
        unchecked = {k: v for k, v in params.items() if k != "remote_kv_layout"}  # the pull itself checks it too
        assert consumer.load(consumer.request("d-6", tokens, unchecked), [7, 8, 9]) == (2 * BLOCK, {7, 8})
        stepping.wait_sent("p-6", timeout_s=0.5)
    finally:
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize(("change", "reason"), [
    ({"kv_role": "kv_both"}, "kv_role: 'kv_both' is not supported by P2pNcclConnector"),
    ({"kv_parallel_size": 1}, r"kv_parallel_size: P2pNcclConnector pairs one prefill and one decode instance \(allowed: 2\)"),
    ({"kv_rank": 1}, "kv_rank: a kv_producer is rank 0 of the pair, got 1"),
    ({"kv_connector_extra_config": {"timeout_s": -1}}, "kv_connector_extra_config.timeout_s: must be a positive"),
    ({"kv_connector_extra_config": {"send_type": "GET"}}, r"unknown key\(s\) send_type"),
])  # fmt: skip
def test_a_config_it_cannot_run_is_refused(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        kv_connector_config({**p2p_config("kv_producer", 1234), **change})


@pytest.mark.parametrize(("role", "params", "reason"), [
    ("kv_producer", {"do_remote_prefill": True}, "do_remote_prefill: this is the prefill instance"),
    ("kv_consumer", {"do_remote_decode": True}, "do_remote_decode: this is the decode instance"),
    ("kv_consumer", {"do_remote_prefill": True, "remote_block_ids": [1, -2], "remote_request_id": "x"},
     "remote_block_ids: must be a list"),
    ("kv_consumer", {"do_remote_prefill": True, "remote_block_ids": [1]}, "remote_request_id: required"),
    ("kv_consumer", {"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "x",
                     "remote_port": 9}, "remote_host/remote_port: None:9 is not this decode instance's prefill"),
    ("kv_consumer", {"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "x",
                     "remote_block_hash": "zz"}, "remote_block_hash: must be the hex string"),
])  # fmt: skip
def test_kv_transfer_params_it_cannot_take_are_refused(role: str, params: dict[str, Any], reason: str) -> None:
    scheduler = P2pNcclConnector(kv_connector_config(p2p_config(role, free_port())), KVConnectorRole.SCHEDULER,
                                 (KVCacheGroupSpec((), BLOCK),))  # fmt: skip
    assert reason in (scheduler.validate_kv_transfer_params(params) or "")
    assert scheduler.validate_kv_transfer_params({"do_remote_decode": False, "remote_block_ids": None}) is None


# ---------------------------------------------------------------------- two engines

MAX_TOKENS = 6
PROMPTS = random_prompts(512, lengths=(37, 50, 64, 21), seed=41)


def _llm(multiprocess: bool, **kwargs: Any) -> LLM:
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "1" if multiprocess else "0"}):
        return LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                   **kwargs)  # fmt: skip


def _greedy(max_tokens: int = MAX_TOKENS, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_transfer_params=params)


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    outputs = _llm(False).generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prefill_engine() -> Iterator[tuple[LLM, int]]:
    port = free_port()
    llm = _llm(True, kv_transfer_config=p2p_config("kv_producer", port))
    yield llm, port
    llm.llm_engine.shutdown()


def prefill_on(engine: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """The proxy's first half: each prompt's prefill (one token), its kv_transfer_params."""
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(1, {"do_remote_decode": True}),
                              use_tqdm=False)  # fmt: skip
    assert all(o.kv_transfer_params is not None and o.kv_transfer_params["do_remote_prefill"] for o in outputs)
    return [o.kv_transfer_params for o in outputs]  # type: ignore[misc]


def decode(engine: LLM, prompts: list[list[int]], params: list[dict[str, Any] | None]) -> tuple[list[Any], int]:
    """The proxy's second half: the outputs, and the tokens the decode engine computed."""
    scheduler = engine.llm_engine.engine_core.core.scheduler
    computed, schedule = 0, scheduler.schedule

    def counting() -> Any:
        nonlocal computed
        output = schedule()
        computed += output.total_num_scheduled_tokens
        return output

    with mock.patch.object(scheduler, "schedule", counting):
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(params=q) for q in params],
                                  use_tqdm=False)  # fmt: skip
    return outputs, computed


def metric(engine: LLM, name: str, **labels: str) -> float:
    return sum(m.value for m in engine.get_metrics()  # type: ignore[attr-defined]
               if m.name == name and labels.items() <= m.labels.items())  # fmt: skip


def test_the_decode_engine_gives_one_engines_tokens_and_computes_only_the_tail(prefill_engine: Any,
                                                                               baseline: list[list[int]]) -> None:  # fmt: skip
    producer, port = prefill_engine
    params = prefill_on(producer, PROMPTS)
    consumer = _llm(False, kv_transfer_config=p2p_config("kv_consumer", port), disable_log_stats=False)
    outputs, computed = decode(consumer, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    pulled = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    assert [o.num_cached_tokens for o in outputs] == pulled
    assert computed == sum(len(p) for p in PROMPTS) - sum(pulled) + (MAX_TOKENS - 1) * len(PROMPTS)
    assert metric(consumer, "kvloom:external_prefix_cache_hits") == sum(pulled)
    assert metric(consumer, "kvloom:kv_connector_hits", tier="remote") == sum(pulled)
    assert metric(consumer, "kvloom:kv_offload_total_blocks", transfer_type="remote_to_device") == sum(pulled) // BLOCK
    # The same prompts again: the decode engine's own prefix cache holds them now, and
    # the prefill engine's blocks are released without a transfer.
    again, computed = decode(consumer, PROMPTS, prefill_on(producer, PROMPTS))
    assert [o.outputs[0].token_ids for o in again] == baseline
    assert metric(consumer, "kvloom:kv_offload_total_blocks", transfer_type="remote_to_device") == sum(pulled) // BLOCK


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_fails_its_request_alone_or_is_recomputed(policy: str, prefill_engine: Any,
                                                                baseline: list[list[int]]) -> None:  # fmt: skip
    producer, port = prefill_engine
    params = prefill_on(producer, PROMPTS)
    params[1] = {**params[1], "remote_block_ids": [b + 100_000 for b in params[1]["remote_block_ids"]]}
    consumer = _llm(False, kv_transfer_config={**p2p_config("kv_consumer", port), "kv_load_failure_policy": policy})
    outputs, _ = decode(consumer, PROMPTS, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    if policy == "fail":
        assert outputs[1].outputs[0].finish_reason == "error" and tokens[1] == []
    else:
        assert tokens[1] == baseline[1] and outputs[1].num_cached_tokens == 0
    assert [t for i, t in enumerate(tokens) if i != 1] == [t for i, t in enumerate(baseline) if i != 1]
    # The engine goes on serving (a plain request, the prefix now cached or not).
    (after,), _ = decode(consumer, [PROMPTS[2]], [None])
    assert after.outputs[0].token_ids == baseline[2]


def test_a_prefill_engine_that_is_gone_fails_only_the_requests_that_need_it(baseline: list[list[int]]) -> None:
    config = {**p2p_config("kv_consumer", free_port(), timeout_s=0.5), "kv_load_failure_policy": "recompute"}
    consumer = _llm(False, kv_transfer_config=config)
    gone = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_request_id": "gone"}
    outputs, _ = decode(consumer, PROMPTS[:2], [gone, None])
    assert [o.outputs[0].token_ids for o in outputs] == baseline[:2]
