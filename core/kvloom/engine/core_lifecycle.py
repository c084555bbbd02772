"""The engine core processes, seen from the process that starts them: start one, wait for
the engine cores' handshake, watch them, stop them, and tell a client when one died.

Not to be confused with ``core_proc.py``, which is the other side: what runs *inside* an
engine core process (``EngineCoreProc``: its threads and busy loop, ``run_engine_core``).
This module runs in its parent: a multiprocess client (``core_client.MPClient``, which
starts its own engine cores) or the launcher of several API servers
(``entrypoints/openai/launcher.py``, which starts them for all the API servers and tells
each one of a death through ``notify_engine_death``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kvloom.engine.core_proc import engine_identity, make_socket, run_engine_core
from kvloom.engine.errors import EngineDeadError
from kvloom.engine.serial import (
    DEAD,
    FAILED,
    READY,
    SHUTDOWN,
    EngineCoreErrorInfo,
    EngineCoreReady,
    MsgpackDecoder,
    MsgpackEncoder,
)
from kvloom.logger import parent_logging
from kvloom.processes import describe_exit, main_module_not_reimported

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

logger = logging.getLogger(__name__)

#: How long shutdown waits for the engine core process to exit before terminating it.
SHUTDOWN_TIMEOUT_S = 10.0

#: What the fork server imports once, so that an engine core forked from it starts with
#: them loaded: torch and the engine (through ``core_proc`` and ``core``), and the part of
#: transformers that unpickling the model's config needs (every model config class of
#: transformers 5 imports ``type_validators``, which pulls in ``torch.distributed.tensor``:
#: about a second on the CPU). A module that a transformers version lacks is skipped.
FORKSERVER_PRELOAD = [
    "kvloom.engine.core_proc",
    "kvloom.engine.core",
    "kvloom.worker.model_runner",
    "transformers.configuration_utils",
    "transformers.utils.type_validators",
]


def forks_engine_cores(config: EngineConfig) -> bool:
    """Whether engine core processes fork from the fork server (``multiprocessing``'s
    ``forkserver``, its imports done once): on the CPU, one replica, POSIX. Elsewhere they
    are spawned, a fresh interpreter each: a GPU process must not inherit anything that
    touched the device, and a data-parallel replica's environment is set before it
    imports torch."""
    return (
        config.device.platform.device_type == "cpu"
        and config.parallel.data_parallel_size == 1
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


def _serialize_exit_status_reads(process: multiprocessing.process.BaseProcess) -> None:
    """One thread at a time reads ``process``'s exit status. A fork-server child's status
    arrives as bytes on its sentinel, read once: when the engine's monitor thread and
    another thread (a caller joining the process) poll together, one reads the status
    and the other meets end-of-file, which ``multiprocessing`` reports as exit code 255,
    possibly overwriting the true code. Spawned processes (``waitpid``) need no lock, but
    it costs nothing there."""
    popen = getattr(process, "_popen", None)
    if popen is None:
        return
    lock = threading.Lock()
    unlocked_poll = popen.poll

    def poll(*args: Any, **kwargs: Any) -> int | None:
        with lock:
            return unlocked_poll(*args, **kwargs)

    popen.poll = poll


def prestart_engine_core_server(config: EngineConfig) -> None:
    """Start the fork server now where ``config``'s engine cores fork from it, so that its
    imports (``FORKSERVER_PRELOAD``: a second interpreter importing torch, seconds on a
    small CPU) overlap the rest of this process's start (the tokenizer) instead of
    following it. Idempotent."""
    if not forks_engine_cores(config):
        return
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    with main_module_not_reimported():
        multiprocessing.forkserver.ensure_running()


def process_context(config: EngineConfig) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context an engine core process starts from."""
    if forks_engine_cores(config):
        prestart_engine_core_server(config)
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def notify_engine_death(ctx: zmq.Context, output_address: str, description: str) -> None:
    """Tell the client reading ``output_address`` that an engine core died: send ``DEAD``
    (as from ``EngineDeadError``) into its own output socket, which wakes whoever waits on
    it. The process that watches an engine core (its parent) calls this."""
    info = EngineCoreErrorInfo(type_name=f"{EngineDeadError.__module__}:EngineDeadError", message=description)
    sock = make_socket(ctx, zmq.PUSH, output_address, bind=False)
    try:
        sock.send_multipart((DEAD, MsgpackEncoder().encode(info)))
    finally:
        sock.close(linger=1000)


@dataclass(frozen=True)
class ClientAddresses:
    """The two sockets of one front end (client ``client_index``), which it binds and
    every engine core connects to: the ``ROUTER`` it sends on, the ``PULL`` it reads."""

    input: str
    output: str


class EngineCoreProcessHandle:
    """This process's handle on one engine core process it started (as a client, or as the
    launcher of several API servers): start, watch, stop."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool,
        clients: list[ClientAddresses],
        engine_index: int = 0,
    ) -> None:
        context = process_context(config)
        # The engine core reads the other end: end of file when this process is gone.
        death_reader, self._death_writer = context.Pipe(duplex=False)
        level, fmt = parent_logging()
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        replicas = config.parallel.data_parallel_size
        env = config.device.platform.data_parallel_env(engine_index, replicas) if replicas > 1 else {}
        # A fork-server child inherits the fork server's environment, as it was when the
        # server started (perhaps by an earlier engine of this process): it is given this
        # process's, as a spawned process would have it.
        environ = dict(os.environ) if context.get_start_method() == "forkserver" else None
        self.process = context.Process(
            target=run_engine_core,
            name=f"kvloom-engine-core-{engine_index}",
            kwargs=dict(
                config=config,
                log_stats=log_stats,
                input_addresses=[c.input for c in clients],
                output_addresses=[c.output for c in clients],
                engine_index=engine_index,
                death_pipe=death_reader,
                log_level=level,
                log_format=fmt,
                env=env,
                environ=environ,
            ),  # fmt: skip
            # A daemonic process may not start processes: with tensor-parallel worker
            # processes the core is not daemonic and ends through its death pipe instead.
            daemon=config.parallel.distributed_executor_backend != "mp",
        )
        with main_module_not_reimported():
            self.process.start()
        _serialize_exit_status_reads(self.process)
        death_reader.close()
        self._stop_reader, self._stop_writer = multiprocessing.Pipe(duplex=False)
        self._monitor: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def check_started(self) -> None:
        """Raise if the process died before it was ready."""
        if not self.process.is_alive():
            self.process.join()
            raise RuntimeError(
                f"Engine core failed to start: its process {describe_exit(self.process.exitcode)} before it "
                "was ready (its log above may say why)"
            )

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(description)`` from a thread when the process dies, unless
        ``stop_monitor()`` was called first."""

        def watch() -> None:
            ready = multiprocessing.connection.wait([self.process.sentinel, self._stop_reader])
            if self._stop_reader in ready:
                return
            self.process.join(timeout=1)  # reap it: no zombie
            on_death(f"The engine core process (pid {self.pid}) {describe_exit(self.process.exitcode)}")

        self._monitor = threading.Thread(target=watch, name="kvloom-engine-core-monitor", daemon=True)
        self._monitor.start()

    def stop_monitor(self) -> None:
        with contextlib.suppress(OSError):
            self._stop_writer.send(None)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)

    def stop(self, send_shutdown: Callable[[], None] | None) -> None:
        """Ask the process to stop (``send_shutdown``; without it, SIGTERM), then
        terminate / kill it if it does not."""
        self.stop_monitor()
        process = self.process
        if process.is_alive():
            if send_shutdown is None:
                process.terminate()
            else:
                with contextlib.suppress(Exception):
                    send_shutdown()
            process.join(timeout=SHUTDOWN_TIMEOUT_S)
        if process.is_alive():
            logger.warning("The engine core (pid %s) did not stop; terminating it", self.pid)
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
        for conn in (self._death_writer, self._stop_reader, self._stop_writer):
            conn.close()


def wait_for_engines(
    sock: zmq.Socket, num_engines: int, processes: list[EngineCoreProcessHandle] | None = None
) -> list[EngineCoreReady]:
    """Wait for ``READY`` from engine cores 0..num_engines-1 on a client's ``ROUTER``
    (they start in parallel); raise on ``FAILED``, or when one of ``processes`` (those
    this process started; the launcher watches the others) dies first."""
    pending = {engine_identity(i): i for i in range(num_engines)}
    ready: list[EngineCoreReady | None] = [None] * num_engines
    while pending:
        if sock.poll(100):
            identity, kind, payload = sock.recv_multipart()
            index = pending.pop(identity, None)
            if index is None:
                logger.warning("Ignoring a handshake from unknown engine %r", identity)
                continue
            if kind == READY:
                ready[index] = MsgpackDecoder(EngineCoreReady).decode(payload)
                continue
            if kind == FAILED:
                info: EngineCoreErrorInfo = MsgpackDecoder(EngineCoreErrorInfo).decode(payload)
                for process in processes or ():
                    if process.engine_index == index:
                        process.process.join(timeout=SHUTDOWN_TIMEOUT_S)
                raise info.to_exception(f"Engine core failed to start: {info.describe()}")
            raise RuntimeError(f"unexpected handshake frame {kind!r} from engine core {index}")
        for process in processes or ():
            if process.identity in pending:
                process.check_started()
    return [r for r in ready if r is not None]


class MPClientResources:
    """What a multiprocess client holds and must release: its sockets, its ZMQ context,
    the engine core processes it started and the directory of its IPC sockets. A
    finalizer of the client calls ``close()``, so an ``LLM`` that is dropped stops its
    engine cores."""

    def __init__(self, starts_engines: bool) -> None:
        self.closed = False
        self.ctx = zmq.Context()
        # A launcher that starts the engine cores owns the directory of the sockets.
        self.ipc_dir = tempfile.mkdtemp(prefix="kvloom-") if starts_engines else None
        self.input_socket: zmq.Socket | None = None
        self.output_socket: zmq.Socket | None = None
        self.async_output: zmq.asyncio.Socket | None = None
        self.processes: list[EngineCoreProcessHandle] = []

    def _send_shutdown(self, identity: bytes) -> None:
        assert self.input_socket is not None
        self.input_socket.send_multipart((identity, SHUTDOWN, b""), flags=zmq.NOBLOCK)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            for process in self.processes:
                process.stop(functools.partial(self._send_shutdown, process.identity))
        finally:
            for sock in (self.async_output, self.input_socket, self.output_socket):
                if sock is not None:
                    with contextlib.suppress(Exception):
                        sock.close(linger=0)
            self.ctx.term()
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
