"""EngineCoreClient: how a front end talks to the engine core.

Two implementations share one interface:

* ``InprocClient`` runs the core in the caller's thread (``LLM``, offline batches): each
  ``get_output()`` is one ``step()``.
* ``ThreadedClient`` runs the core's busy loop in a background thread (``AsyncLLM``):
  requests and aborts go in through a thread-safe queue and are admitted between steps,
  outputs come back through an asyncio queue. Heavy torch work releases the GIL, so the
  HTTP server keeps answering while the model runs.

A client that runs the core in its own process (ZMQ, as vLLM does) fits the same
interface; ``utility()`` calls are the extension point for anything else.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.core import EngineCore
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs
from kvloom.request import EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core failed; no further requests can be served."""


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def utility(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` between steps and return its result."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
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

    def utility(self, fn: Callable[[EngineCore], Any]) -> Any:
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
        self.dead: BaseException | None = None
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
        if ids and self.dead is None:
            self._inbox.put(("abort", ids))

    def utility(self, fn: Callable[[EngineCore], Any]) -> Future:
        self._check_alive()
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

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
        if self.dead is not None:
            raise EngineDeadError(f"engine core failed: {self.dead!r}") from self.dead

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
            self.dead = e
            if self.loop is not None:
                try:
                    self._publish(e)
                except RuntimeError:  # event loop already closed
                    pass
