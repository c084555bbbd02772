"""The conformance kit of KV connectors (``kvloom.interfaces.KVConnectorBase``).

``check_kv_connector(kv_transfer_config)`` drives a connector's two sides through the
contract's calls, the way the scheduler and the model runner do, over a KV cache of
random data (no model runs), and returns what it found wrong (an empty list: conforms)::

    problems = check_kv_connector({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    assert not problems, "\\n".join(problems)

The cases:

* **round trip**: random requests (random lengths, their blocks at random device
  blocks) are saved, each up to a random number of its full blocks; a lookup of each then
  finds exactly the saved run of blocks (never the request's last token), and loading
  them into other random device blocks gives the saved blocks bit for bit (synchronously
  in the step, or asynchronously, reported once in ``finished_recving``);
* **missing blocks**: a request nothing was saved for is not found; one whose first
  blocks were saved is found up to them only;
* **the edges**: the metadata pickles (it crosses to worker processes); an unknown
  ``kv_connector_extra_config`` key is refused with a reason naming it; a request that
  ends without being scheduled, or while its asynchronous load runs, is handled (its load
  still reported once); every kept request is reported in ``finished_sending``.

With ``across_engines=True`` the loads run on fresh instances (another engine sharing the
storage, as a decode instance shares its prefill instance's), else on the saving ones (a
connector whose store is the engine's own, such as host memory).
``KVConnectorHarness`` is the driver, for a plugin's own tests.
"""

from __future__ import annotations

import pickle
import random
import time
from typing import Any

import torch

from kvloom.config import EngineConfig
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.kv_transfer.base import (
    KVCacheGroupSpec,
    KVConnectorBase,
    KVConnectorRole,
    KVConnectorStep,
    ScheduledKVRequest,
)
from kvloom.kv_transfer.blocks import KVLayerCache, block_dim_of
from kvloom.kv_transfer.factory import make_connector
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

__all__ = ["KVConnectorHarness", "check_kv_connector", "kv_connector_config"]

#: How long the kit waits for an asynchronous transfer to be reported.
ASYNC_TIMEOUT_S = 30.0


def kv_connector_config(kv_transfer_config: dict[str, Any], **engine_args: Any) -> EngineConfig:
    """The engine config of a tiny random Llama (fp32, block size 16, 128 KV blocks) with
    ``kv_transfer_config``, resolved as the engine would (the connector installed, or named
    by ``kv_connector_module_path``)."""
    from kvloom.testing.models import tiny_model_dir

    args = dict(model=str(tiny_model_dir("llama")), dtype="float32", block_size=16, num_gpu_blocks_override=128,
                kv_transfer_config=kv_transfer_config)  # fmt: skip
    args.update(engine_args)
    return create_engine_config(EngineArgs(**args))


class KVConnectorHarness:
    """One engine's connector, both sides, over a KV cache of random data: ``save`` and
    ``load`` requests as the engine's steps would."""

    def __init__(self, config: EngineConfig, seed: int = 0) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_gpu_blocks_override or 128
        self.hash_fn = get_hash_function(config.cache.prefix_caching_hash_algo)
        model, backend = config.model, config.attention.backend
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers))
        self.scheduler: KVConnectorBase = make_connector(config, KVConnectorRole.SCHEDULER,
                                                         (KVCacheGroupSpec((), self.block_size),))  # fmt: skip
        self.worker: KVConnectorBase = make_connector(config, KVConnectorRole.WORKER,
                                                      (KVCacheGroupSpec(names, self.block_size),))  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        shape = backend.get_kv_cache_shape(self.num_blocks, self.block_size, model.num_kv_heads, model.head_size)
        dim = block_dim_of(backend.get_kv_cache_shape, self.block_size, model.num_kv_heads, model.head_size)
        self.device = torch.device(config.device.device_type)  # the cache lives where the engine's would
        self.layers = {n: KVLayerCache(n, torch.randn(shape, generator=gen, dtype=model.dtype).to(self.device), dim)
                       for n in names}  # fmt: skip
        self.worker.register_kv_caches(self.layers)

    def request(self, request_id: str, tokens: list[int], params: dict[str, Any] | None = None) -> Request:
        """A request of ``tokens`` with its block hashes (``params``: its kv_transfer_params)."""
        request = Request(request_id, tokens, SamplingParams(max_tokens=1, kv_transfer_params=params))
        update_block_hashes(request, self.block_size, self.hash_fn)
        return request

    def blocks_of(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The data of ``block_ids`` in every layer (copies)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return [layer.gather(ids).cpu() for layer in self.layers.values()]

    def step(self, scheduled: list[ScheduledKVRequest], finished: set[str] = frozenset()) -> tuple[set[str], set[str], set[int]]:  # type: ignore[assignment]
        """One engine step: the scheduler side's metadata (pickled and unpickled, as it
        crosses to worker processes), the worker side's loads, per-layer waits and saves;
        returns (finished_sending, finished_recving, failed blocks)."""
        meta = self.scheduler.build_connector_meta(KVConnectorStep(scheduled, set(finished)))
        meta = pickle.loads(pickle.dumps(meta))
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        for name, layer in self.layers.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, layer.tensor, None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(set(finished))
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        return set(sending or ()), set(recving or ()), set(errors)

    def save(self, request: Request, block_ids: list[int], num_tokens: int) -> dict[str, Any] | None:
        """Compute (as far as the connector knows) the first ``num_tokens`` tokens of
        ``request`` into ``block_ids``, end the request, and wait until its blocks may be
        freed; its output ``kv_transfer_params``."""
        request.num_computed_tokens = 0
        self.scheduler.update_state_after_alloc(request, (block_ids,), 0)
        self.step([ScheduledKVRequest(request, 0, num_tokens, True, lambda: (block_ids,))])
        request.num_computed_tokens = num_tokens
        keep, params = self.scheduler.request_finished(request, (block_ids,))
        self._wait(request.request_id, sending=keep, finished={request.request_id})
        return params

    def load(self, request: Request, block_ids: list[int]) -> tuple[int, set[int]]:
        """Admit ``request`` into ``block_ids``: the tokens the connector supplies (loaded
        into the blocks), and the blocks it reported failed."""
        num_tokens, load_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        if not num_tokens:
            return 0, set()
        request.num_computed_tokens = 0
        self.scheduler.update_state_after_alloc(request, (block_ids,), num_tokens)
        if load_async:  # the request waits: steps without it until its load is reported
            return num_tokens, self._wait(request.request_id, recving=True)
        rest = ScheduledKVRequest(request, num_tokens, request.num_tokens - num_tokens, True, lambda: (block_ids,))
        return num_tokens, self.step([rest])[2]

    def _wait(self, request_id: str, sending: bool = False, recving: bool = False,
              finished: set[str] = frozenset()) -> set[int]:  # type: ignore[assignment]  # fmt: skip
        errors: set[int] = set()
        deadline = time.monotonic() + ASYNC_TIMEOUT_S
        while True:
            sent, received, failed = self.step([], finished)
            finished = set()
            errors |= failed
            sending = sending and request_id not in sent
            recving = recving and request_id not in received
            if not (sending or recving):
                return errors
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id}: its transfer was not reported in {ASYNC_TIMEOUT_S} s")
            time.sleep(0.005)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def check_kv_connector(
    kv_transfer_config: dict[str, Any],
    *,
    across_engines: bool = False,
    num_requests: int = 6,
    seed: int = 0,
    **engine_args: Any,
) -> list[str]:
    """Run the kit's cases (module docstring) on the connector of ``kv_transfer_config``;
    the problems found (empty: it conforms)."""
    problems: list[str] = []
    config = kv_connector_config(kv_transfer_config, **engine_args)
    cls = type(make_connector(config, KVConnectorRole.SCHEDULER, (KVCacheGroupSpec((), config.cache.block_size),)))
    probe = config.model_copy(deep=False)
    probe.kv_transfer = config.kv_transfer.model_copy(  # type: ignore[union-attr]
        update={"kv_connector_extra_config": {**config.kv_transfer.kv_connector_extra_config, "no_such_key": 1}})  # type: ignore[union-attr]
    if not any("no_such_key" in r for r in cls.validate_config(probe)):
        problems.append("validate_config: an unknown kv_connector_extra_config key (no_such_key) is not refused")
    saver = KVConnectorHarness(config, seed)
    loader = KVConnectorHarness(config, seed + 1) if across_engines else saver
    rng = random.Random(seed)
    bs, free = config.cache.block_size, list(range(saver.num_blocks))
    saved: list[tuple[list[int], dict[str, Any] | None]] = []
    try:
        for i in range(num_requests):
            num_blocks = rng.randint(1, 5)
            tokens = [rng.randrange(1, config.model.vocab_size) for _ in range(num_blocks * bs + rng.randint(0, bs - 1))]
            saved_blocks = num_blocks if i % 2 == 0 else rng.randint(0, num_blocks - 1)
            try:
                problems += _round_trip(saver, loader, f"{i}", tokens, saved_blocks, rng, free, saved)
            except Exception as exc:  # a connector that raises does not conform; the kit goes on
                problems.append(f"request of {len(tokens)} tokens ({saved_blocks} block(s) saved): "
                                f"{type(exc).__name__}: {exc}")  # fmt: skip
        try:
            saver.scheduler.request_finished(saver.request("never-scheduled", list(range(1, 3 * bs))), ([],))
            if saved:
                problems += _abort_while_loading(loader, *saved[0], rng.sample(free, 8))
        except Exception as exc:
            problems.append(f"a request that ended unscheduled or while loading: {type(exc).__name__}: {exc}")
    finally:
        saver.shutdown()
        if loader is not saver:
            loader.shutdown()
    return problems


def _round_trip(saver: KVConnectorHarness, loader: KVConnectorHarness, name: str, tokens: list[int],
                saved_blocks: int, rng: random.Random, free: list[int],
                saved: list[tuple[list[int], dict[str, Any] | None]]) -> list[str]:  # fmt: skip
    """Save the first ``saved_blocks`` blocks of a request, then look it up and load it."""
    bs = saver.block_size
    num_blocks = len(tokens) // bs
    what = f"request of {len(tokens)} tokens ({saved_blocks} block(s) saved)"
    src = rng.sample(free, num_blocks + 1)
    params = saver.save(saver.request(f"save-{name}", tokens), src, saved_blocks * bs)
    saved.append((tokens, params))
    dst = rng.sample(free, num_blocks + 1)
    request = loader.request(f"load-{name}", tokens, params)
    found, _ = loader.scheduler.get_num_new_matched_tokens(request, 0)
    limit = min(saved_blocks * bs, ((len(tokens) - 1) // bs) * bs)
    if found != limit:
        return [f"{what}: the lookup found {found} tokens, not {limit}"]
    before = loader.blocks_of(dst)
    found, failed = loader.load(request, dst)
    problems = [f"{what}: its load reported failed blocks {sorted(failed)}"] if failed else []
    n = found // bs
    want, got = saver.blocks_of(src[:n]), loader.blocks_of(dst[:n])
    if not all(torch.equal(w.view(torch.uint8), g.view(torch.uint8)) for w, g in zip(want, got)):
        problems.append(f"{what}: the {n} loaded block(s) differ from the saved ones")
    if not all(torch.equal(a[n:], b[n:]) for a, b in zip(before, loader.blocks_of(dst))):
        problems.append(f"{what}: blocks past the loaded ones were written")
    keep, _ = loader.scheduler.request_finished(request, (dst,))
    loader._wait(request.request_id, sending=keep, finished={request.request_id})
    return problems


def _abort_while_loading(harness: KVConnectorHarness, tokens: list[int], params: dict[str, Any] | None,
                         block_ids: list[int]) -> list[str]:  # fmt: skip
    """A request that ends while its asynchronous load runs: the load is still reported, once."""
    request = harness.request("aborted-while-loading", tokens, params)
    num_tokens, load_async = harness.scheduler.get_num_new_matched_tokens(request, 0)
    if not (num_tokens and load_async):
        return []
    request.num_computed_tokens = 0
    harness.scheduler.update_state_after_alloc(request, (block_ids,), num_tokens)
    harness.scheduler.request_finished(request, (block_ids,))
    try:
        harness._wait(request.request_id, recving=True, finished={request.request_id})
    except TimeoutError as exc:
        return [f"a request aborted while its KV loaded: {exc}"]
    return []
