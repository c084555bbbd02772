"""EngineCoreClient: how a front end talks to the engine core.

With multiprocessing (the default, ``KVLOOM_ENABLE_MULTIPROCESSING=1``), the engine core
runs in its own process (``core_proc.EngineCoreProc``), so tokenization,
detokenization, HTTP and JSON in the front end never compete with the scheduler and the
model runner for one interpreter lock:

* ``SyncMPClient`` (``LLM`` / ``LLMEngine``): ``get_output()`` blocks on the output socket;
* ``AsyncMPClient`` (``AsyncLLM``, the server): ``get_output_async()`` awaits it in the
  event loop.

Both send ``[identity, kind, payload]`` frames on a ``ROUTER`` socket that the engine core
connects to with a ``DEALER`` (identity = its engine index) and receive its outputs on a
``PULL`` socket it ``PUSH``es to, all msgpack (``serial.py``). Several engine cores (data
parallelism, ``engine/load_balancer.py`` picks one per request) connect to the same
``ROUTER`` and ``PULL`` (outputs carry their ``engine_index``); several front-end
processes (``kvloom serve --api-server-count``) each bind their own pair, given by the
launcher, and stamp their requests with their ``client_index``. A monitor thread watches
each engine core process this client started (the launcher watches the ones it started);
when one dies (killed, or a failed step), every open request gets ``EngineDeadError`` at
once. Starting, watching and stopping those processes is ``core_lifecycle.py``.

With ``KVLOOM_ENABLE_MULTIPROCESSING=0`` the core stays in the front end's process, for
debugging and tests that reach into it: ``InprocClient`` (``LLM``: each ``get_output()``
is one ``step()`` in the caller's thread) and ``ThreadedClient`` (``AsyncLLM``: the busy
loop in a background thread).

Utility calls cross the boundary by name (``call_utility("add_lora", lora_request)``,
the names in ``core_proc.UTILITY_METHODS``): functions cannot be sent to another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from kvloom.config import EngineConfig
from kvloom.engine.core import EngineCore
from kvloom.engine.core_lifecycle import (
    ClientAddresses,
    EngineCoreProcessHandle,
    MPClientResources,
    notify_engine_death,
    prestart_engine_core_server,
    wait_for_engines,
)
from kvloom.engine.core_proc import call_utility, engine_identity, make_socket
from kvloom.engine.errors import EngineDeadError
from kvloom.engine.load_balancer import LoadBalancer
from kvloom.engine.serial import (
    ABORT,
    ADD,
    DEAD,
    OUTPUTS,
    UTILITY,
    UTILITY_OUTPUT,
    EngineCoreErrorInfo,
    MsgpackEncoder,
    UtilityOutput,
    UtilityRequest,
    output_decoders,
)
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs
from kvloom.request import EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)

#: ``KVLOOM_ENABLE_MULTIPROCESSING``: 1 (default) runs the engine core in its own process.
MULTIPROCESSING_ENV = "KVLOOM_ENABLE_MULTIPROCESSING"


def multiprocessing_enabled() -> bool:
    """Whether the engine core runs in its own process (``KVLOOM_ENABLE_MULTIPROCESSING``,
    default 1)."""
    value = os.environ.get(MULTIPROCESSING_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{MULTIPROCESSING_ENV}={value!r}: expected 1 or 0")


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    #: Why the engine core is dead (None while it lives).
    dead_error: BaseException | None = None

    @staticmethod
    def prepare(config: EngineConfig) -> None:
        """Begin what ``make_client`` will wait for, so the caller's own start overlaps it:
        the fork server of the engine core processes (on the CPU) starts importing."""
        if multiprocessing_enabled():
            prestart_engine_core_server(config)

    @staticmethod
    def make_client(config: EngineConfig, log_stats: bool, asyncio_mode: bool) -> "EngineCoreClient":
        """The client ``KVLOOM_ENABLE_MULTIPROCESSING`` asks for: the core in its own
        process, or in this one (the caller's thread, or a background thread for
        asyncio)."""
        if multiprocessing_enabled():
            return AsyncMPClient(config, log_stats) if asyncio_mode else SyncMPClient(config, log_stats)
        if config.parallel.data_parallel_size > 1:
            raise ValueError(f"--data-parallel-size {config.parallel.data_parallel_size} needs the engine cores in "
                             f"processes of their own; {MULTIPROCESSING_ENV}=0 keeps one in this process")  # fmt: skip
        return ThreadedClient(config, log_stats) if asyncio_mode else InprocClient(config, log_stats)


# ===================================================================== in-process


class InprocClient(EngineCoreClient):
    """The core in the caller's thread: each ``get_output()`` is one ``step()``."""

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.core = EngineCore(config, log_stats=log_stats)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self.core.abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    def call_utility(self, method: str, *args: Any) -> Any:
        return call_utility(self.core, method, args)

    def utility(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` (in-process clients only: for tests and debugging)."""
        return fn(self.core)

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedClient(EngineCoreClient):
    """The core's busy loop in a daemon thread; outputs land in an asyncio queue."""

    _STOP = object()

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.core = EngineCore(config, log_stats=log_stats)
        # Bound to the front end's event loop on first use (attach); the engine thread
        # produces no output before a request arrives, which needs the loop.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.dead_error = None
        self._thread = threading.Thread(target=self._run, name="kvloom-engine-core", daemon=True)
        self._thread.start()

    # ---- called from the front end's thread
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is not None and self.loop is not loop:
            raise RuntimeError("the engine is already bound to another event loop")
        if self.loop is None:
            self.outputs = asyncio.Queue()
            self.loop = loop

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._inbox.put(("add", request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and self.dead_error is None:
            self._inbox.put(("abort", ids))

    def utility(self, fn: Callable[[EngineCore], Any]) -> Future:
        """Run ``fn(core)`` between steps (in-process clients only: for tests and
        debugging); returns a concurrent future."""
        self._check_alive()
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.utility(lambda core: call_utility(core, method, args)))

    async def get_output_async(self) -> EngineCoreOutputs:
        assert self.outputs is not None, "attach() the event loop first"
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            raise EngineDeadError(f"engine core failed: {item!r}") from item
        return item

    def shutdown(self) -> None:
        self._inbox.put((self._STOP, None))
        self._thread.join(timeout=30)
        self.core.shutdown()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine core failed: {self.dead_error!r}") from self.dead_error

    # ---- the engine thread
    def _handle(self, kind: Any, payload: Any) -> bool:
        if kind is self._STOP:
            return False
        if kind == "add":
            try:
                self.core.add_request(payload)
            except ValueError as e:  # bad request: reject it, keep serving the rest
                logger.warning("Rejected request %s: %s", payload.request_id, e)
                self._reject(payload.request_id)
        elif kind == "abort":
            self.core.abort_requests(payload)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn(self.core))
            except Exception as e:  # report to the caller, keep serving
                future.set_exception(e)
        return True

    def _reject(self, request_id: str) -> None:
        out = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)])
        self._publish(out)

    def _publish(self, item: EngineCoreOutputs | BaseException) -> None:
        assert self.loop is not None and self.outputs is not None
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)

    def _run(self) -> None:
        try:
            while True:
                # Block for work when idle; otherwise admit whatever arrived, then step.
                if not self.core.has_work():
                    kind, payload = self._inbox.get()
                    if not self._handle(kind, payload):
                        return
                while True:
                    try:
                        kind, payload = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(kind, payload):
                        return
                if self.core.has_work():
                    self._publish(self.core.step())
        except BaseException as e:  # the loop must report, never die silently
            logger.exception("Engine core loop failed")
            self.dead_error = e
            if self.loop is not None:
                try:
                    self._publish(e)
                except RuntimeError:  # event loop already closed
                    pass


# ===================================================================== multiprocess
class MPClient(EngineCoreClient):
    """The parts the sync and asyncio multiprocess clients share: sockets, the engine
    core processes, sending, the death of an engine.

    By default the client starts its own engine core and watches it. With ``addresses``
    (an API server among several, given them by ``entrypoints/openai/launcher.py``) it
    binds those and waits for the engine cores the launcher started to connect; the
    launcher watches them and sends ``DEAD`` here when one dies
    (``notify_engine_death``). ``client_index`` goes on every request and utility call,
    so that the engine core answers this client only.

    With ``data_parallel_size`` N there are N engine cores behind the one ``ROUTER``
    (identities 0..N-1): each new request goes to the least loaded (``LoadBalancer``), its
    aborts to the same one, and utility calls to all of them. Any engine core that dies
    is the death of the whole engine."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        client_index: int = 0,
        addresses: ClientAddresses | None = None,
    ) -> None:
        self.config = config
        self.client_index = client_index
        self.dead_error = None
        self._engine_reported = False
        self.resources = resources = MPClientResources(starts_engines=addresses is None)
        self._finalizer = weakref.finalize(self, resources.close)
        if addresses is None:
            addresses = ClientAddresses(f"ipc://{resources.ipc_dir}/input", f"ipc://{resources.ipc_dir}/output")
        self.input_address, self.output_address = addresses.input, addresses.output
        num_engines = config.parallel.data_parallel_size
        self.identities = [engine_identity(i) for i in range(num_engines)]
        self.balancer = LoadBalancer(num_engines) if num_engines > 1 else None
        #: With data parallelism: the engine core holding each unfinished core request.
        self._engine_of: dict[str, int] = {}
        self._encoder = MsgpackEncoder()
        self._decoders = output_decoders()
        self._call_ids = itertools.count(1)
        try:
            resources.input_socket = make_socket(resources.ctx, zmq.ROUTER, self.input_address, bind=True)
            resources.output_socket = make_socket(resources.ctx, zmq.PULL, self.output_address, bind=True)
            if resources.ipc_dir is not None:
                for index in range(num_engines):  # all start (load their model) at once
                    resources.processes.append(EngineCoreProcessHandle(config, log_stats, [addresses], index))
            self.ready = wait_for_engines(resources.input_socket, len(self.identities), resources.processes)
        except BaseException:  # failed, or interrupted (Ctrl-C while the model loads)
            self.shutdown()
            raise
        self._input_socket, self._output_socket = resources.input_socket, resources.output_socket
        # The values the engine core resolved (the front end's config is a copy).
        config.cache.num_blocks = min(ready.num_blocks for ready in self.ready)
        client = weakref.ref(self)  # the monitor must not keep the client alive

        def on_death(description: str) -> None:
            alive = client()
            if alive is not None:
                alive._on_engine_death(description)

        for process in resources.processes:
            process.start_monitor(on_death)

    @property
    def engine(self) -> EngineCoreProcessHandle:
        """Engine core 0's process, when this client started it (tests and debugging)."""
        return self.resources.processes[0]

    @property
    def closed(self) -> bool:
        return self.resources.closed

    # ------------------------------------------------------------- sending
    def _send(self, kind: bytes, obj: Any, engine: int = 0) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error)) from self.dead_error
        if self.closed:
            raise EngineDeadError("the engine core client is shut down")
        data = self._encoder.encode(obj)
        try:
            self._input_socket.send_multipart((self.identities[engine], kind, data), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    def _route(self, request: EngineCoreRequest) -> int:
        """The engine core for a new request (stamped with this client's index)."""
        request.client_index = self.client_index
        if self.balancer is None:
            return 0
        self._engine_of[request.request_id] = engine = self.balancer.choose()
        return engine

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, [request], self._route(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if not ids or self.dead_error is not None or self.closed:
            return
        by_engine: dict[int, list[str]] = {}
        for request_id in ids:
            if self.balancer is None:
                by_engine.setdefault(0, []).append(request_id)
            elif request_id in self._engine_of:  # (not there: finished already)
                by_engine.setdefault(self._engine_of.pop(request_id), []).append(request_id)
        with contextlib.suppress(EngineDeadError):
            for engine, engine_ids in by_engine.items():
                self._send(ABORT, engine_ids, engine)

    def _received(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Note what an engine core's outputs say about it: its load, its finished requests."""
        if self.balancer is not None:
            if outputs.load is not None:
                self.balancer.update(outputs.engine_index, outputs.load)
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self._engine_of.pop(output.request_id, None)
        return outputs

    def _new_utility_requests(self, method: str, args: tuple[Any, ...]) -> list[UtilityRequest]:
        """One call per engine core (utility calls go to every one)."""
        return [UtilityRequest(next(self._call_ids), method, list(args), client_index=self.client_index)
                for _ in self.identities]  # fmt: skip

    @staticmethod
    def _combined(results: list[Any]) -> Any:
        """The result of a utility call to every engine core: a bool is True only if every
        engine's is (e.g. ``reset_prefix_cache``); anything else is engine 0's (the
        engines hold the same LoRAs)."""
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0]

    # ------------------------------------------------------------- receiving
    def _decode(self, frames: list[Any]) -> tuple[bytes, Any]:
        kind = frames[0].bytes
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise RuntimeError(f"unexpected output frame kind {kind!r} from the engine core")
        return kind, decoder.decode(frames[1].buffer)

    #: Seconds a reader that got the monitor's DEAD waits for the engine core's own report
    #: (sent before it exited, so normally there already): it names the cause.
    ENGINE_REPORT_WAIT_S = 0.2

    @staticmethod
    def _from_monitor(info: EngineCoreErrorInfo) -> bool:
        return info.short_type == "EngineDeadError"

    def _dead(self, info: EngineCoreErrorInfo) -> EngineDeadError:
        """Record the engine's death and return the error. The engine core's own report
        (the error of a failed step) wins over the monitor's (how the process ended)."""
        if not self._from_monitor(info) and not self._engine_reported:
            self._engine_reported = True
            error = EngineDeadError(f"The engine core failed: {info.describe()}")
            error.__cause__ = info.to_exception()
            self.dead_error = error
            logger.error("%s", error)
        elif self.dead_error is None:
            self.dead_error = EngineDeadError(info.message)
        return EngineDeadError(str(self.dead_error))

    @staticmethod
    def _utility_result(output: UtilityOutput) -> Any:
        if output.error is not None:
            raise output.error.to_exception()
        return output.result

    # ------------------------------------------------------------- death and shutdown
    def _on_engine_death(self, description: str) -> None:
        """From the monitor thread: record the death and wake whoever reads outputs, by
        sending DEAD to our own output socket."""
        if self.closed:
            return
        if self.dead_error is None:
            self.dead_error = EngineDeadError(description)
            logger.error("%s", description)
        with contextlib.suppress(zmq.ZMQError):  # the client is closing
            notify_engine_death(self.resources.ctx, self.output_address, str(self.dead_error))

    def shutdown(self) -> None:
        """Stop the engine core (SHUTDOWN, then SIGTERM, then SIGKILL) and release
        everything; idempotent."""
        self._finalizer()


class SyncMPClient(MPClient):
    """For ``LLMEngine``: blocking ``get_output()``; utility calls wait for their result
    (outputs that arrive meanwhile are kept for ``get_output()``).

    Requests added between two ``get_output()`` calls go to the engine core together, in
    one message, before it waits for outputs (or sends an abort or a utility call): the
    engine core admits them together, so an ``LLM.generate`` batch starts as one batch,
    as it does with the core in-process."""

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self._pending: deque[EngineCoreOutputs] = deque()
        self._unsent: list[EngineCoreRequest] = []
        super().__init__(config, log_stats)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error)) from self.dead_error
        self._unsent.append(request)

    def _flush(self) -> None:
        if self._unsent:
            requests, self._unsent = self._unsent, []
            by_engine: dict[int, list[EngineCoreRequest]] = {}
            for request in requests:
                by_engine.setdefault(self._route(request), []).append(request)
            for engine, engine_requests in by_engine.items():
                self._send(ADD, engine_requests, engine)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        if self._unsent:  # not sent yet: forget them here
            self._unsent = [r for r in self._unsent if r.request_id not in ids]
        super().abort_requests(ids)

    def _recv(self) -> tuple[bytes, Any]:
        sock = self._output_socket
        while not sock.poll(1000):
            if self.dead_error is not None and not all(p.process.is_alive() for p in self.resources.processes):
                raise EngineDeadError(str(self.dead_error))
        kind, obj = self._decode(sock.recv_multipart(copy=False))
        if kind == DEAD:
            error = self._dead(obj)
            deadline = time.monotonic() + self.ENGINE_REPORT_WAIT_S
            while self._from_monitor(obj) and sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
                follow_kind, follow = self._decode(sock.recv_multipart(copy=False))
                if follow_kind == DEAD and not self._from_monitor(follow):
                    error = self._dead(follow)
                    break
            raise error
        return kind, obj

    def get_output(self) -> EngineCoreOutputs:
        self._flush()
        if self._pending:
            return self._pending.popleft()
        while True:
            kind, obj = self._recv()
            if kind == OUTPUTS:
                return self._received(obj)
            logger.warning("Ignoring a utility result nobody waits for (call %s)", obj.call_id)

    def has_unfinished_requests(self) -> bool:
        # The front end knows which requests are unfinished; the core's are not visible here.
        return bool(self._pending)

    def call_utility(self, method: str, *args: Any) -> Any:
        self._flush()
        requests = self._new_utility_requests(method, args)
        for engine, request in enumerate(requests):
            self._send(UTILITY, request, engine)
        answers: dict[int, UtilityOutput] = {}
        while len(answers) < len(requests):
            kind, obj = self._recv()
            if kind == OUTPUTS:
                self._pending.append(self._received(obj))
            elif any(obj.call_id == r.call_id for r in requests):
                answers[obj.call_id] = obj
        return self._combined([self._utility_result(answers[r.call_id]) for r in requests])


class AsyncMPClient(MPClient):
    """For ``AsyncLLM``: ``get_output_async()`` reads the output socket in the event
    loop (one reader: the output handler); utility results resolve their futures there."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        client_index: int = 0,
        addresses: ClientAddresses | None = None,
    ) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._async_output: zmq.asyncio.Socket | None = None
        self._utility_futures: dict[int, asyncio.Future] = {}
        super().__init__(config, log_stats, client_index, addresses)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is not None and self.loop is not loop:
            raise RuntimeError("the engine is already bound to another event loop")
        if self.loop is None:
            self.loop = loop
            self._async_output = zmq.asyncio.Socket.from_socket(self._output_socket)
            self.resources.async_output = self._async_output

    async def get_output_async(self) -> EngineCoreOutputs:
        assert self._async_output is not None, "attach() the event loop first"
        while True:
            if self.closed:
                raise EngineDeadError(str(self.dead_error or "the engine core client is shut down"))
            kind, obj = self._decode(await self._async_output.recv_multipart(copy=False))
            if kind == OUTPUTS:
                return self._received(obj)
            if kind == UTILITY_OUTPUT:
                future = self._utility_futures.pop(obj.call_id, None)
                if future is not None and not future.done():
                    try:
                        future.set_result(self._utility_result(obj))
                    except Exception as e:
                        future.set_exception(e)
                continue
            error = self._dead(obj)
            sock = self._async_output
            deadline = time.monotonic() + self.ENGINE_REPORT_WAIT_S
            while self._from_monitor(obj) and await sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
                follow_kind, follow = self._decode(await sock.recv_multipart(copy=False))
                if follow_kind == DEAD and not self._from_monitor(follow):
                    error = self._dead(follow)
                    break
            self._fail_utility_calls()
            raise error

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        assert self.loop is not None, "attach() the event loop first"
        futures = []
        for engine, request in enumerate(self._new_utility_requests(method, args)):
            future = self.loop.create_future()
            self._utility_futures[request.call_id] = future
            futures.append(future)
            try:
                self._send(UTILITY, request, engine)
            except BaseException:
                self._utility_futures.pop(request.call_id, None)
                raise
        return self._combined(list(await asyncio.gather(*futures)))

    def _fail_utility_calls(self) -> None:
        futures, self._utility_futures = self._utility_futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(self.dead_error)))
