"""The link between a prefill engine (rank 0, the producer) and a decode engine (rank 1,
the consumer): a ``TCPStore`` at ``kv_ip:kv_port`` that the producer hosts, and a
two-rank ``torch.distributed`` process group of their own built on it (gloo for a KV
cache on the CPU, NCCL on CUDA), apart from any group the engines run their model with.

The consumer pulls. It writes a pull (which blocks of which finished prefill, and its KV
layout) under ``<generation>/pull/<n>``; the producer's server thread answers under
``<generation>/reply/<n>`` (ok, or why not) and, if ok, sends the blocks layer by layer
over the group, which the consumer receives and scatters into its own blocks. Pulls are
served one at a time, in order. A consumer that connects (again) opens a new generation
(``kvloom_p2p/generation``): both sides build a new group under it, so a consumer that
restarted, or gave up on a transfer half done, never reads a stale send.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvloom.interfaces import KVLayerCache, KVTransferStats

logger = logging.getLogger(__name__)

#: The store's counter of the consumer's connections.
GENERATION_KEY = "kvloom_p2p/generation"
#: The producer's poll of the store for pulls: from this while busy up to ``IDLE_POLL_S``.
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.02
#: Transfer types in the stats.
SEND_KIND, RECV_KIND = "device_to_remote", "remote_to_device"


class TransferError(RuntimeError):
    """A pull the producer refused, or a transfer that did not complete."""


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what gloo binds to), or ``host``
    itself when it is one of ours; ``""`` (gloo's default) if it cannot be told."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a UDP "connect" sends nothing: it picks the route
            return str(s.getsockname()[0])
    except OSError:
        return ""


def new_group(store: dist.Store, rank: int, backend: str, timeout: timedelta, local_host: str) -> Any:
    """A two-rank process group on ``store`` (rank 0: the producer), NCCL or gloo."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


@dataclass
class Offer:
    """A finished prefill's blocks, held until the consumer pulls them or ``deadline``."""

    block_ids: list[int]
    deadline: float


class Endpoint:
    """What both ends share: the KV cache, its device and stream, the stats."""

    def __init__(self, layers: dict[str, KVLayerCache], layout: str, timeout_s: float) -> None:
        self.layers = layers
        self.layout = layout
        self.timeout = timedelta(seconds=timeout_s)
        self.device = next(iter(layers.values())).tensor.device
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.lock = threading.Lock()
        self.stats = KVTransferStats()

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the block: on CUDA on the transfer stream (synchronized when it ends, so that
        its blocks may be used or freed afterwards)."""
        if self.stream is None:
            with torch.no_grad():
                yield
            return
        torch.cuda.set_device(self.device)  # NCCL binds its communicator to the thread's device
        with torch.no_grad(), torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def count(self, kind: str, blocks: int, start: float) -> None:
        nbytes = blocks * sum(c.block_nbytes for c in self.layers.values())
        with self.lock:
            self.stats.count_transfer(kind, blocks, nbytes, time.perf_counter() - start)

    def take_stats(self) -> KVTransferStats:
        with self.lock:
            stats, self.stats = self.stats, KVTransferStats()
        return stats


class ProducerLink(Endpoint):
    """Rank 0: hosts the store and serves pulls on a thread of its own (module docstring).
    ``offer`` holds a finished prefill's blocks; ``take_finished`` names the requests whose
    blocks may be freed (sent, released by the consumer, refused, or held past their
    deadline)."""

    def __init__(self, host: str, port: int, layers: dict[str, KVLayerCache], layout: str, timeout_s: float) -> None:
        super().__init__(layers, layout, timeout_s)
        self.host, self.port = host, port
        try:  # now, so that a port in use fails the engine's start with a clear reason
            self.store = dist.TCPStore(host, port, None, True, self.timeout, wait_for_workers=False)
        except RuntimeError as exc:  # torch.distributed.DistError
            raise RuntimeError(f"P2pNcclConnector: cannot listen on kv_ip:kv_port {host}:{port} ({exc})") from None
        self.offers: dict[str, Offer] = {}
        self.finished: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_forever, name="kvloom-p2p-producer", daemon=True)
        self._thread.start()

    def offer(self, request_id: str, block_ids: list[int], hold_s: float) -> None:
        with self.lock:
            self.offers[request_id] = Offer(block_ids, time.monotonic() + hold_s)

    def take_finished(self) -> set[str]:
        now = time.monotonic()
        with self.lock:
            expired = [r for r, offer in self.offers.items() if offer.deadline < now]
            for request_id in expired:
                logger.warning("P2pNcclConnector: request %s was not pulled by the decode instance in time; its "
                               "blocks are freed (abort_request_timeout_s)", request_id)  # fmt: skip
                del self.offers[request_id]
            finished, self.finished = self.finished | set(expired), set()
        return finished

    def _claim(self, request_id: str) -> Offer | None:
        """Take the offer of ``request_id``, waiting for it a while: the consumer may ask
        before this engine's next step has registered it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._stop.is_set():
            with self.lock:
                offer = self.offers.pop(request_id, None)
            if offer is not None or time.monotonic() > deadline:
                return offer
            time.sleep(BUSY_POLL_S * 5)
        return None

    def _serve_forever(self) -> None:
        generation, group, next_pull, poll = 0, None, 1, BUSY_POLL_S
        while not self._stop.is_set():
            try:
                current = int(self.store.add(GENERATION_KEY, 0))
                if current != generation:  # a consumer (re)connected: a new group
                    generation, group, next_pull = current, None, 1
                    prefix = dist.PrefixStore(f"kvloom_p2p/{generation}/group", self.store)
                    group = new_group(prefix, 0, self.backend, self.timeout, self.host)
                    logger.info("P2pNcclConnector: the decode instance connected (%s, generation %d)",
                                self.backend, generation)  # fmt: skip
                key = f"kvloom_p2p/{generation}/pull/{next_pull}"
                if not generation or not self.store.check([key]):
                    time.sleep(poll)
                    poll = min(poll * 2, IDLE_POLL_S)
                    continue
                pull = json.loads(self.store.get(key))
                self.store.delete_key(key)
                self._serve(group, f"kvloom_p2p/{generation}/reply/{next_pull}", pull)
                next_pull, poll = next_pull + 1, BUSY_POLL_S
            except Exception:
                if self._stop.is_set():
                    return
                logger.exception("P2pNcclConnector: serving the decode instance failed; waiting for it to reconnect")
                group = None
                time.sleep(IDLE_POLL_S)

    def _serve(self, group: Any, reply_key: str, pull: dict[str, Any]) -> None:
        request_id, wanted = str(pull.get("request_id")), [int(b) for b in pull.get("block_ids", [])]
        if pull.get("layout") != self.layout:
            return self._reply(reply_key, f"the decode instance's KV layout ({pull.get('layout')}) is not the prefill "
                               f"instance's ({self.layout}): serve the same model (and --served-model-name), dtype, "
                               "KV-cache dtype, block size and attention backend on both")  # fmt: skip
        offer = self._claim(request_id)
        if offer is None:
            return self._reply(reply_key, f"request {request_id} is not held by the prefill instance (never "
                               "prefilled there with do_remote_decode, already pulled, or freed after "
                               "abort_request_timeout_s)")  # fmt: skip
        with self.lock:
            self.finished.add(request_id)  # sent, or refused: the consumer will not ask again
        if not set(wanted) <= set(offer.block_ids):
            return self._reply(reply_key, f"remote_block_ids {sorted(set(wanted) - set(offer.block_ids))[:8]} are "
                               f"not blocks of request {request_id}")  # fmt: skip
        if wanted and group is None:
            return self._reply(reply_key, "the prefill instance has no transfer group (it failed to connect)")
        self._reply(reply_key, None)
        if not wanted:
            return None  # the consumer had them cached: a release
        start = time.perf_counter()
        with self.on_stream():
            ids = torch.tensor(wanted, dtype=torch.int64, device=self.device)
            for tag, cache in enumerate(self.layers.values()):
                group.send([cache.gather(ids).contiguous()], 1, tag).wait()
        self.count(SEND_KIND, len(wanted), start)
        return None

    def _reply(self, key: str, error: str | None) -> None:
        if error is not None:
            logger.warning("P2pNcclConnector: refused a pull: %s", error)
        self.store.set(key, json.dumps({"error": error}))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class ConsumerLink(Endpoint):
    """Rank 1: connects to the producer on first use (again after a failure) and pulls,
    on the caller's thread (the connector's loader thread)."""

    def __init__(self, host: str, port: int, layers: dict[str, KVLayerCache], layout: str, timeout_s: float) -> None:
        super().__init__(layers, layout, timeout_s)
        self.host, self.port = host, port
        self._store: dist.TCPStore | None = None
        self._group: Any = None
        self._prefix = ""
        self._next_pull = 1

    def _connect(self) -> None:
        if self._store is not None:
            return
        try:
            store = dist.TCPStore(self.host, self.port, None, False, self.timeout)
        except RuntimeError as exc:  # torch.distributed.DistNetworkError
            raise TransferError(f"cannot reach the prefill instance at {self.host}:{self.port} ({exc})") from None
        generation = int(store.add(GENERATION_KEY, 1))
        self._prefix = f"kvloom_p2p/{generation}"
        group_store = dist.PrefixStore(f"{self._prefix}/group", store)
        with self.on_stream():
            self._group = new_group(group_store, 1, self.backend, self.timeout, local_address_towards(self.host))
        self._store, self._next_pull = store, 1
        logger.info("P2pNcclConnector: connected to the prefill instance at %s:%d (%s, generation %d)",
                    self.host, self.port, self.backend, generation)  # fmt: skip

    def pull(self, request_id: str, remote_ids: list[int], local_ids: list[int], ready: Any = None) -> None:
        """Copy the producer's blocks ``remote_ids`` of its request ``request_id`` into our
        blocks ``local_ids`` (none: tell it the blocks are not needed). ``ready``: a CUDA
        event the writes must wait for. ``TransferError`` (or the group's error) if not."""
        try:
            self._connect()
            self._pull(request_id, remote_ids, local_ids, ready)
        except TransferError:
            raise
        except Exception:
            self._store = self._group = None  # a half-done transfer: the next pull reconnects
            raise

    def _pull(self, request_id: str, remote_ids: list[int], local_ids: list[int], ready: Any) -> None:
        assert self._store is not None
        n, self._next_pull = self._next_pull, self._next_pull + 1
        reply_key = f"{self._prefix}/reply/{n}"
        self._store.set(f"{self._prefix}/pull/{n}", json.dumps({"request_id": request_id, "block_ids": remote_ids,
                                                                 "layout": self.layout}))  # fmt: skip
        self._store.wait([reply_key], 2 * self.timeout)  # the producer may wait timeout_s for the request itself
        error = json.loads(self._store.get(reply_key))["error"]
        self._store.delete_key(reply_key)
        if error is not None:
            raise TransferError(f"the prefill instance refused: {error}")
        if not remote_ids:
            return
        start = time.perf_counter()
        with self.on_stream():
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            ids = torch.tensor(local_ids, dtype=torch.int64, device=self.device)
            for tag, cache in enumerate(self.layers.values()):
                buffer = torch.empty((len(local_ids), *cache.block_shape), dtype=cache.tensor.dtype, device=self.device)
                self._group.recv([buffer], 0, tag).wait()
                cache.scatter(ids, buffer)
        self.count(RECV_KIND, len(local_ids), start)
