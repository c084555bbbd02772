"""``kvloom serve --api-server-count N``: N API server processes over shared engine cores.

The serving process becomes a launcher (vLLM's API server scale-out):

* it binds and listens on the HTTP socket once (``kvloom serve`` does, before anything
  else: ``bind_listening_socket``), and resolves the ``EngineConfig`` once:
  the API servers inherit that one listening socket and each accepts from it, so the
  kernel hands every new connection to one of them, a port in use is reported once,
  before anything starts, and no other process can join the port (``SO_REUSEPORT``
  would let any process of the same user bind it too, and hashes connections to
  processes whether they are ready or not);
* it starts the engine core process(es) (``core_lifecycle.EngineCoreProcessHandle``), each told the ZMQ
  addresses of every API server (one ``ROUTER`` and one ``PULL`` per API server, IPC
  sockets in a private temporary directory), then the API server processes, API server
  ``i`` with ``client_index`` ``i`` and its own two addresses. Each one binds them, waits
  for every engine core's ``READY`` and serves HTTP (``api_server.serve_engine``);
* with ``PROMETHEUS_MULTIPROC_DIR`` pointing at a temporary directory (unless the user
  set one), the API servers write their metrics there and ``/metrics`` sums them
  whichever answers (``metrics/loggers.py``);
* then it watches them all. SIGINT/SIGTERM stop the API servers (SIGTERM: a graceful
  uvicorn shutdown), then the engine cores, and it exits 0. An engine core that dies is
  reported to every API server (``notify_engine_death``: open requests fail at once,
  /health answers 503, each API server exits 1), and the launcher exits 1 once they are
  gone. An API server that dies makes the launcher stop everything and exit 1. The
  children exit by themselves when the launcher is killed (end of file on a pipe whose
  write end only the launcher holds), so no process is left behind.
"""

from __future__ import annotations

import copy
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

import kvloom
from kvloom.config import EngineConfig
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.core_lifecycle import ClientAddresses, EngineCoreProcessHandle, notify_engine_death
from kvloom.entrypoints.openai import event_loop
from kvloom.entrypoints.openai.limits import ServerLimits
from kvloom.entrypoints.openai.server_options import FrontendOptions
from kvloom.logger import parent_logging, setup_child_logging
from kvloom.processes import describe_exit, main_module_not_reimported
from kvloom.profiling import cprofile_if_asked

logger = logging.getLogger(__name__)

#: How long the API servers get to stop gracefully before they are killed.
API_SERVER_STOP_TIMEOUT_S = 30.0
#: How long an API server waits once the launcher is gone before it exits regardless.
PARENT_DEATH_GRACE_S = 10.0


@dataclass(frozen=True)
class ServerOptions:
    """What every API server is told besides its engine addresses."""

    host: str
    port: int
    api_key: str | None
    uvicorn_log_level: str
    access_log: bool
    limits: ServerLimits | None
    frontend: FrontendOptions = FrontendOptions()


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening, for every API server to accept from."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart while old connections linger
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# ----------------------------------------------------------------- the API server process


def _watch_parent(death_pipe: Any) -> None:
    """Stop this API server (gracefully, as the launcher would) when the launcher is gone."""
    try:
        death_pipe.recv()
    except (EOFError, OSError):
        pass
    logger.warning("The launcher of this API server is gone; shutting down")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(PARENT_DEATH_GRACE_S)
    os._exit(1)


def run_api_server(
    index: int,
    config: EngineConfig,
    sock: socket.socket,
    addresses: ClientAddresses,
    options: ServerOptions,
    death_pipe: Any,
    log_level: int | None,
    log_format: str | None,
) -> None:
    """API server ``index``'s process: an ``AsyncLLM`` connected to the launcher's engine
    cores, serving HTTP on the shared socket. Exits 0 when stopped by SIGTERM, 1 when
    the engine core died or the server failed."""
    from kvloom.engine.async_llm import AsyncLLM
    from kvloom.entrypoints.openai.api_server import build_app, serve_engine
    from kvloom.metrics.loggers import PrometheusStatLogger

    prefix = f"(APIServer_{index} pid={os.getpid()}) "
    setup_child_logging(log_level, log_format, prefix)
    # The launcher stops this process (SIGTERM); Ctrl-C in a terminal reaches the whole
    # process group, so it is ignored here until uvicorn runs (which shuts down on it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(death_pipe,), name="kvloom-api-server-parent-watch",
                     daemon=True).start()  # fmt: skip
    import uvicorn
    import uvicorn.config

    # uvicorn's own lines (access log included) say which API server wrote them.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in log_config["formatters"].values():
        formatter["fmt"] = prefix + formatter["fmt"]
    # One API server counts the engine's own events (prefix cache, preemptions): every API
    # server receives the same scheduler stats.
    prometheus = functools.partial(PrometheusStatLogger, count_engine_events=index == 0)

    async def serve() -> int:
        # Made in the event loop, so that its output handler runs from the start (and sees
        # the engine core's death even before any request).
        engine = AsyncLLM(config, stat_loggers=[prometheus], client_index=index, client_addresses=addresses)
        try:
            app = build_app(engine, api_key=options.api_key, limits=options.limits, frontend=options.frontend)
            uv_config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
                                       access_log=options.access_log, log_config=log_config,
                                       **options.frontend.uvicorn_kwargs())  # fmt: skip
            # uvicorn handles SIGTERM while it serves, and raises it again once it stopped:
            # ignored from here on.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return await serve_engine(engine, uv_config, sock)
        finally:
            engine.shutdown()

    status = 1
    try:
        with cprofile_if_asked("api_server", index):
            status = event_loop.run(serve())
    except Exception:
        logger.exception("API server %d failed", index)
    sys.exit(status)


# ----------------------------------------------------------------- the launcher


class _Stop(Exception):
    """SIGINT or SIGTERM reached the launcher."""


def launch(engine_args: EngineArgs, options: ServerOptions, api_server_count: int, sock: socket.socket) -> int:
    """Run ``api_server_count`` API servers, accepting from ``sock`` (``bind_listening_socket``'s;
    the caller closes it), over the engine core(s) until a signal (exit status 0) or a
    failure of any process (1). See the module's docstring."""
    config = create_engine_config(engine_args)
    log_stats = not config.observability.disable_log_stats
    workdir = tempfile.mkdtemp(prefix="kvloom-serve-")
    own_metrics_dir = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    if own_metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(workdir, "metrics")
        os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    else:
        logger.warning("PROMETHEUS_MULTIPROC_DIR is set (%s): the API servers' metrics go there, and it is not "
                       "cleaned up", os.environ["PROMETHEUS_MULTIPROC_DIR"])  # fmt: skip
    clients = [ClientAddresses(f"ipc://{workdir}/input-{i}", f"ipc://{workdir}/output-{i}")
               for i in range(api_server_count)]  # fmt: skip
    ctx = zmq.Context()
    engines: list[EngineCoreProcessHandle] = []
    servers: list[multiprocessing.Process] = []
    death_writers: list[Any] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stop(signal.Signals(signum).name)
        logger.info("kvloom serve is already shutting down")

    for sig in previous:
        signal.signal(sig, on_signal)
    status = 0
    try:
        num_engines = config.parallel.data_parallel_size
        engines = [EngineCoreProcessHandle(config, log_stats, clients, engine_index=e) for e in range(num_engines)]
        spawn = multiprocessing.get_context("spawn")
        level, fmt = parent_logging()
        for index, addresses in enumerate(clients):
            death_reader, death_writer = spawn.Pipe(duplex=False)
            death_writers.append(death_writer)
            process = spawn.Process(
                target=run_api_server,
                name=f"kvloom-api-server-{index}",
                args=(index, config, sock, addresses, options, death_reader, level, fmt),
            )
            with main_module_not_reimported():
                process.start()
            death_reader.close()
            servers.append(process)
        logger.info("kvloom %s serving %s on http://%s:%d with %d API servers and %d engine core%s (launcher pid "
                    "%d)", kvloom.__version__, config.model.served_model_name, options.host, options.port,
                    api_server_count, num_engines, "s" if num_engines > 1 else "", os.getpid())  # fmt: skip
        status = _watch(engines, servers, clients, ctx)
    except _Stop as stop:
        logger.info("kvloom serve stopping (%s)", stop)
    finally:
        stopping = True
        try:
            _stop_servers(servers)
            for engine in engines:
                engine.stop(send_shutdown=None)  # SIGTERM: the engine core stops cleanly
        finally:
            for writer in death_writers:
                writer.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            ctx.term()
            if own_metrics_dir:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            shutil.rmtree(workdir, ignore_errors=True)
    return status


def _watch(
    engines: list[EngineCoreProcessHandle],
    servers: list[multiprocessing.Process],
    clients: list[ClientAddresses],
    ctx: zmq.Context,
) -> int:
    """Block until a process ends; return 1 once whatever must follow it has happened."""
    from kvloom.entrypoints.openai.api_server import ENGINE_DEATH_FORCE_EXIT_S, ENGINE_DEATH_GRACE_S

    owner = {engine.process.sentinel: engine for engine in engines}
    owner.update({server.sentinel: server for server in servers})
    ended = multiprocessing.connection.wait(list(owner))
    gone = owner[ended[0]]
    if isinstance(gone, EngineCoreProcessHandle):
        gone.process.join(timeout=1)
        description = f"The engine core process (pid {gone.pid}) {describe_exit(gone.process.exitcode)}"
        logger.critical("%s; every API server fails its open requests and exits, then kvloom serve (exit "
                        "status 1)", description)  # fmt: skip
        for addresses in clients:
            try:
                notify_engine_death(ctx, addresses.output, description)
            except zmq.ZMQError as exc:
                logger.warning("Could not tell an API server (%s) that the engine core died: %s", addresses.output,
                               exc)  # fmt: skip
        # They stop by themselves after answering their open requests.
        deadline = time.monotonic() + ENGINE_DEATH_GRACE_S + ENGINE_DEATH_FORCE_EXIT_S + 5
        for server in servers:
            server.join(timeout=max(deadline - time.monotonic(), 0))
    else:
        gone.join(timeout=1)
        logger.critical("API server %s (pid %s) %s; kvloom serve is shutting down (exit status 1)",
                        gone.name.rsplit("-", 1)[-1], gone.pid, describe_exit(gone.exitcode))  # fmt: skip
    return 1


def _stop_servers(servers: list[multiprocessing.Process]) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL after ``API_SERVER_STOP_TIMEOUT_S``."""
    for server in servers:
        if server.is_alive():
            server.terminate()
    deadline = time.monotonic() + API_SERVER_STOP_TIMEOUT_S
    for server in servers:
        server.join(timeout=max(deadline - time.monotonic(), 0))
        if server.is_alive():
            logger.warning("API server %s (pid %s) did not stop; killing it", server.name, server.pid)
            server.kill()
            server.join()
