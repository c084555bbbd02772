"""EngineCoreProc: the engine core in its own process (vLLM's ``EngineCoreProc``).

This module is what runs *inside* the engine core process; its parent's side (start the
process, wait for its handshake, watch it, stop it) is ``core_lifecycle.py``. The front
end (``SyncMPClient`` for ``LLM``, ``AsyncMPClient`` for ``AsyncLLM`` and the server, in
``core_client.py``) starts ``run_engine_core`` in a process of the ``spawn`` context (CUDA
cannot be used in a forked child). The ``EngineConfig`` arrives pickled by
multiprocessing (the platform and backend classes it holds pickle by reference; plugins
load here too, in ``EngineCore``). Three threads then share the work, so that the busy
loop only schedules and steps:

* the input thread receives ``[kind, payload]`` frames on its input sockets (one
  ``DEALER`` per client, identity = the engine index), decodes them (``serial.py``) and
  puts them on the input queue;
* the busy loop (the main thread) admits what the input queue holds between steps (add,
  abort, utility calls), runs ``EngineCore.step()`` while there is work (async
  scheduling included: ``step()`` keeps its steps in flight) and blocks on the queue
  when there is none; each step's outputs go to the output queue;
* the output thread encodes them and sends them on the output sockets (one ``PUSH`` per
  client).

Several front ends (API server processes, ``client_index`` 0..N-1) can share one engine
core: it connects to each one's ``ROUTER`` and ``PULL``, remembers which client sent each
request (``EngineCoreRequest.client_index``), and sends a request's outputs, and a utility
call's result, only to that client. Scheduler stats, the load (with data parallelism,
``EngineLoad``) and ``DEAD`` go to every client.

Startup handshake, on every input socket: ``READY`` with ``EngineCoreReady`` (the number of
KV blocks and the pid), or ``FAILED`` with the exception that stopped it (type, message,
traceback). A step that raises kills the engine core: the error goes out as ``DEAD`` and
the process exits with status 1 (the front end's monitor also notices a process that
vanished, e.g. killed). The process ignores SIGINT (Ctrl-C in a terminal reaches the
whole process group; the front end shuts it down), stops cleanly on SIGTERM or a
``SHUTDOWN`` frame, and exits by itself when its parent dies (the parent holds the write
end of a pipe whose read end is watched here: end of file = parent gone).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from kvloom.config import EngineConfig
from kvloom.engine.serial import (
    ABORT,
    ADD,
    DEAD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_OUTPUT,
    EngineCoreErrorInfo,
    EngineCoreReady,
    MsgpackEncoder,
    UtilityOutput,
    UtilityRequest,
    convert_args,
    input_decoders,
)
from kvloom.logger import dump_stacks_on_sigusr1, setup_child_logging
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs, EngineLoad
from kvloom.profiling import cprofile_if_asked
from kvloom.request import FinishReason
from kvloom.utils import freeze_gc_heap

if TYPE_CHECKING:
    from kvloom.engine.core import EngineCore

logger = logging.getLogger(__name__)

#: How long the engine core waits for its busy loop to stop once its parent is gone.
PARENT_DEATH_GRACE_S = 5.0

#: Internal input kind: the output thread failed; the busy loop re-raises the error.
_FATAL = b"\xff"

#: The client index of an output message for every client.
ALL_CLIENTS = -1


# ----------------------------------------------------------------- utility calls


def core_state(core: Any) -> dict[str, Any]:
    """The scheduler's state between two steps (for tests and debugging)."""
    scheduler = core.scheduler
    return {
        "num_unfinished_requests": scheduler.get_num_unfinished_requests(),
        "num_running_requests": len(scheduler.running),
        "num_waiting_requests": len(scheduler.waiting),
        "kv_cache_usage": scheduler.kv_cache_manager.usage,
        "has_work": core.has_work(),
        "gc_frozen_objects": gc.get_freeze_count(),  # freeze_gc_heap() ran (in the core's process)
    }


def host_conditions(core: Any) -> dict[str, Any]:
    """The conditions the engine core's process computes under (its worker's, at tensor-
    parallel size 1): torch's intra-op threads and the CPUs it may run on. What a
    comparison against another engine must give that engine too (``kvloom bench
    throughput --compare-hf``)."""
    import torch

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS)
        cpus = list(range(os.cpu_count() or 1))
    return {"torch_threads": torch.get_num_threads(), "cpu_affinity": cpus, "pid": os.getpid()}


#: The utility calls a front end may make, by name: EngineCore methods, and functions
#: taking the core first.
UTILITY_METHODS: dict[str, Any] = {
    "add_lora": None,
    "remove_lora": None,
    "list_loras": None,
    "reset_prefix_cache": None,
    "core_state": core_state,
    "host_conditions": host_conditions,
}


def call_utility(core: EngineCore, method: str, args: list[Any] | tuple[Any, ...]) -> Any:
    """Run the utility ``method`` on ``core`` (arguments typed as its annotations say)."""
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown engine core utility {method!r} (known: {', '.join(sorted(UTILITY_METHODS))})")
    fn = UTILITY_METHODS[method]
    if fn is None:
        bound = getattr(core, method)
        return bound(*convert_args(bound, list(args)))
    return fn(core, *args)


def engine_identity(engine_index: int) -> bytes:
    """The input socket identity of engine core ``engine_index`` (how a ROUTER in the
    front end addresses it; with data parallelism several connect to one ROUTER)."""
    return engine_index.to_bytes(2, "little")


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, identity: bytes | None = None) -> zmq.Socket:
    """A socket with no high-water mark (a ROUTER drops messages at its HWM) and no
    linger unless set later."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an engine that is gone is an error, not a drop
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


# ----------------------------------------------------------------- the process


class EngineCoreProc:
    """An ``EngineCore`` behind ZMQ sockets: input thread, busy loop, output thread."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool,
        input_addresses: list[str],
        output_addresses: list[str],
        engine_index: int = 0,
    ) -> None:
        from kvloom.engine.core import EngineCore

        #: One of several replicas: every step's outputs carry the load, for every client.
        self.publish_load = config.parallel.data_parallel_size > 1
        if not input_addresses or len(input_addresses) != len(output_addresses):
            raise ValueError(f"one input and one output address per client, got {input_addresses} and "
                             f"{output_addresses}")  # fmt: skip
        self.engine_index = engine_index
        self.input_queue: queue.SimpleQueue[tuple[bytes, Any]] = queue.SimpleQueue()
        #: (client index, or ALL_CLIENTS; kind; message), or None to stop.
        self.output_queue: queue.SimpleQueue[tuple[int, bytes, Any] | None] = queue.SimpleQueue()
        #: With several clients: which one sent each request the core holds (its outputs go
        #: there only). With one, everything goes to it as it is.
        self._client_of: dict[str, int] | None = {} if len(output_addresses) > 1 else None
        self.ctx = zmq.Context()
        identity = engine_identity(engine_index)
        self.input_sockets = [make_socket(self.ctx, zmq.DEALER, address, bind=False, identity=identity)
                              for address in input_addresses]  # fmt: skip
        self.output_sockets = [make_socket(self.ctx, zmq.PUSH, address, bind=False) for address in output_addresses]
        # Messages sent before an exit (the handshake, DEAD) are delivered first.
        for sock in (*self.input_sockets, *self.output_sockets):
            sock.setsockopt(zmq.LINGER, 5000)
        self._threads: list[threading.Thread] = []
        encoder = MsgpackEncoder()
        try:
            self.core: EngineCore = EngineCore(config, log_stats=log_stats)
        except BaseException as exc:
            try:
                failed = encoder.encode(EngineCoreErrorInfo.from_exception(exc))
                for sock in self.input_sockets:
                    sock.send_multipart((FAILED, failed))
            finally:
                for sock in (*self.input_sockets, *self.output_sockets):
                    sock.close()
                self.ctx.term()  # after the FAILED frames went out (or their linger ran out)
            raise
        # The engine core's start-up state lives as long as this process: out of the full
        # garbage collections' way (they would walk it every ~100 steps).
        freeze_gc_heap()
        ready = encoder.encode(EngineCoreReady(pid=os.getpid(), num_blocks=int(config.cache.num_blocks or 0)))
        for sock in self.input_sockets:
            sock.send_multipart((READY, ready))
        # From here on each socket belongs to one thread.
        for target, name in ((self._input_loop, "input"), (self._output_loop, "output")):
            thread = threading.Thread(target=target, name=f"kvloom-engine-core-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # ------------------------------------------------------------- input thread
    def _input_loop(self) -> None:
        decoders = input_decoders()
        poller = zmq.Poller()
        for sock in self.input_sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    frames = sock.recv_multipart(copy=False)
                    kind = frames[0].bytes
                    if kind == SHUTDOWN:
                        self.input_queue.put((SHUTDOWN, None))
                        continue
                    decoder = decoders.get(kind)
                    if decoder is None:
                        raise ValueError(f"unknown input frame kind {kind!r}")
                    self.input_queue.put((kind, decoder.decode(frames[1].buffer)))
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # a message it cannot read: the engine cannot go on
            logger.exception("Engine core input thread failed")
            self.input_queue.put((_FATAL, exc))
        finally:
            for sock in self.input_sockets:
                sock.close(linger=0)

    # ------------------------------------------------------------- output thread
    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        socks = self.output_sockets
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    return
                client, kind, obj = item
                try:
                    data = encoder.encode(obj)
                except Exception as exc:
                    if kind != UTILITY_OUTPUT:
                        raise
                    # A utility result that cannot be sent is that call's error.
                    error = EngineCoreErrorInfo.from_exception(exc)
                    data = encoder.encode(UtilityOutput(obj.call_id, error=error))
                for sock in socks if client == ALL_CLIENTS else (socks[client],):
                    sock.send_multipart((kind, data), copy=False)
        except BaseException as exc:
            logger.exception("Engine core output thread failed")
            dead = encoder.encode(EngineCoreErrorInfo.from_exception(exc))
            for sock in socks:
                with contextlib.suppress(Exception):
                    sock.send_multipart((DEAD, dead))
            self.input_queue.put((_FATAL, exc))
        finally:
            for sock in socks:
                sock.close()  # with its linger: pending messages go out

    # ------------------------------------------------------------- busy loop
    def run_busy_loop(self) -> None:
        core, inbox, outbox = self.core, self.input_queue, self.output_queue
        while True:
            # Block for work when idle; otherwise admit whatever arrived, then step.
            if not core.has_work():
                if not self._handle_input(*inbox.get()):
                    return
            while not inbox.empty():
                if not self._handle_input(*inbox.get_nowait()):
                    return
            if core.has_work():
                outputs = core.step()
                if self.publish_load:
                    scheduler = core.scheduler
                    outputs.load = EngineLoad(len(scheduler.waiting), len(scheduler.running),
                                              scheduler.kv_cache_manager.usage)  # fmt: skip
                if outputs.outputs or outputs.finished_requests or outputs.scheduler_stats is not None or outputs.load:
                    for client, client_outputs in self._split_by_client(outputs).items():
                        outbox.put((client, OUTPUTS, client_outputs))

    def _split_by_client(self, outputs: EngineCoreOutputs) -> dict[int, EngineCoreOutputs]:
        """One step's outputs, as one message per client: each request's outputs go to
        the client that sent it; the scheduler stats and the load go to every client
        (each front end logs the stats, and routes by the loads of the engine cores)."""
        outputs.engine_index = self.engine_index
        client_of = self._client_of
        if client_of is None:
            return {0: outputs}
        split: dict[int, EngineCoreOutputs] = {}

        def of(client: int) -> EngineCoreOutputs:
            if client not in split:
                split[client] = EngineCoreOutputs(timestamp=outputs.timestamp, engine_index=self.engine_index,
                                                  scheduler_stats=outputs.scheduler_stats, load=outputs.load)  # fmt: skip
            return split[client]

        for output in outputs.outputs:
            client = client_of.get(output.request_id)
            if client is None:  # cannot happen: every request came in an ADD
                logger.error("Dropping an output of request %s, which no client sent", output.request_id)
                continue
            of(client).outputs.append(output)
        for request_id in outputs.finished_requests:
            client = client_of.get(request_id)
            if client is not None:
                of(client).finished_requests.add(request_id)
        for output in outputs.outputs:
            if output.finish_reason is not None:
                client_of.pop(output.request_id, None)
        if outputs.scheduler_stats is not None or outputs.load is not None:
            for client in range(len(self.output_sockets)):
                of(client)
        return split

    def _handle_input(self, kind: bytes, payload: Any) -> bool:
        if kind == ADD:
            for request in payload:
                if not 0 <= request.client_index < len(self.output_sockets):
                    raise ValueError(f"request {request.request_id!r} names client {request.client_index}; this "
                                     f"engine core has {len(self.output_sockets)} clients")  # fmt: skip
                client_of = self._client_of
                if client_of is not None:
                    if request.request_id in client_of:
                        # Ids are random per front end; a clash must not misroute the first one's outputs.
                        self._reject(request, "request id already in use in the engine core")
                        continue
                    client_of[request.request_id] = request.client_index
                try:
                    self.core.add_request(request)
                except ValueError as e:  # a bad request: reject it, keep serving the rest
                    if client_of is not None:
                        del client_of[request.request_id]
                    self._reject(request, str(e))
        elif kind == ABORT:
            self.core.abort_requests(payload)
        elif kind == UTILITY:
            self.output_queue.put((payload.client_index, UTILITY_OUTPUT, self._run_utility(payload)))
        elif kind == SHUTDOWN:
            return False
        elif kind == _FATAL:
            raise payload
        return True

    def _reject(self, request: Any, reason: str) -> None:
        logger.warning("Rejected request %s: %s", request.request_id, reason)
        rejected = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
        outputs = EngineCoreOutputs(outputs=[rejected], timestamp=time.monotonic(), engine_index=self.engine_index)
        self.output_queue.put((request.client_index, OUTPUTS, outputs))

    def _run_utility(self, request: UtilityRequest) -> UtilityOutput:
        try:
            return UtilityOutput(request.call_id, result=call_utility(self.core, request.method, request.args))
        except Exception as exc:  # the caller's error; the engine goes on
            return UtilityOutput(request.call_id, error=EngineCoreErrorInfo.from_exception(exc))

    # ------------------------------------------------------------- exit
    def report_dead(self, exc: BaseException) -> None:
        self.output_queue.put((ALL_CLIENTS, DEAD, EngineCoreErrorInfo.from_exception(exc)))

    def shutdown(self) -> None:
        """Flush the output queue, stop the threads, shut the core down."""
        self.output_queue.put(None)
        for thread in self._threads:
            if thread.name.endswith("output"):
                thread.join(timeout=10)
        try:
            self.core.shutdown()
        finally:
            self.ctx.term()  # wakes the input thread (ContextTerminated), waits for the sends


def _watch_parent(death_pipe: Any, inbox: list[queue.SimpleQueue]) -> None:
    """Block until the parent process is gone (end of file on the pipe), then stop: ask
    the busy loop (``inbox``, filled once it exists) to shut down, and exit regardless
    after a grace period (a long step, or a core still loading)."""
    try:
        death_pipe.recv()
    except (EOFError, OSError):
        pass
    logger.warning("The engine core's parent process is gone; shutting down")
    if inbox:
        inbox[0].put((SHUTDOWN, None))
    time.sleep(PARENT_DEATH_GRACE_S)
    os._exit(1)


def _setup_logging(level: int | None, fmt: str | None, engine_index: int) -> None:
    if level is None:
        return
    setup_child_logging(level, fmt, f"(EngineCore_{engine_index} pid={os.getpid()}) ")


def run_engine_core(
    config: EngineConfig,
    log_stats: bool,
    input_addresses: list[str],
    output_addresses: list[str],
    engine_index: int = 0,
    death_pipe: Any = None,
    log_level: int | None = None,
    log_format: str | None = None,
    env: dict[str, str] | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    """The engine core process's target: build the core, handshake, run the busy loop.
    Exits 0 after a SHUTDOWN frame or SIGTERM, 1 after a failure. ``environ``: the whole
    environment to take (the starting process's, for a fork-server child); ``env``:
    variables set on top before the core is built (a data-parallel replica's device,
    ``Platform.data_parallel_env``)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(env or {})
    _setup_logging(log_level, log_format, engine_index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dump_stacks_on_sigusr1()
    terminated = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal terminated
        if not terminated:
            terminated = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    proc: EngineCoreProc | None = None
    status = 0
    inbox: list[queue.SimpleQueue] = []
    if death_pipe is not None:
        threading.Thread(target=_watch_parent, args=(death_pipe, inbox), name="kvloom-engine-core-parent-watch",
                         daemon=True).start()  # fmt: skip
    try:
        proc = EngineCoreProc(config, log_stats, input_addresses, output_addresses, engine_index)
        inbox.append(proc.input_queue)
        with cprofile_if_asked("engine_core", engine_index):
            proc.run_busy_loop()
    except SystemExit:
        logger.info("Engine core stopped by SIGTERM")
    except BaseException as exc:
        status = 1
        if proc is None and isinstance(exc, (ValueError, FileNotFoundError)):
            # Bad input (a flag, a file): the front end reports the message, which says
            # what to do; the traceback is for debugging (KVLOOM_LOGGING_LEVEL=DEBUG).
            logger.error("Engine core failed to start: %s: %s", type(exc).__name__, exc)
            logger.debug("Engine core start failure", exc_info=exc)
        elif proc is None:
            logger.error("Engine core failed to start", exc_info=exc)
        else:
            logger.error("Engine core failed; it is shutting down", exc_info=exc)
            proc.report_dead(exc)
    finally:
        if proc is not None:
            try:
                proc.shutdown()
            except Exception:
                logger.exception("Engine core shutdown failed")
                status = status or 1
    sys.exit(status)
