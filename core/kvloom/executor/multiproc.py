"""``MultiprocExecutor``: one worker process per rank on this machine.

Start-up: the engine core's process spawns ``tensor_parallel_size x
pipeline_parallel_size`` processes (the
``spawn`` start method: CUDA cannot be used in a forked child); each joins a
torch.distributed process group over the backend its platform names
(``Platform.dist_backend``: gloo on the CPU, NCCL on CUDA) with a timeout on every
collective, builds the platform's worker and waits for calls.

Transport: calls go down through a shared-memory broadcast queue
(``kvloom.distributed.shm_broadcast``: one writer, a reader per rank, a ring of
``MQ_CHUNKS`` chunks of ``MQ_CHUNK_BYTES``). Each call (a worker method and its arguments,
e.g. ``execute_model`` with the step's ``SchedulerOutput``) is pickled once and written
once; every rank unpickles it from the ring in place. A call longer than a chunk leaves a
marker in the ring and its bytes follow on each rank's pipe, so calls keep their order.
Replies come up on the pipes: every rank answers on its own, the output rank (the last
pipeline stage's tensor-parallel rank 0; rank 0 without pipeline parallelism) with a
step's result and the others with ``None`` (their outputs are identical or, on earlier
stages, empty, and never leave the process). With pipeline parallelism
``execute_model`` returns once the step is written: the engine core sends the next
micro-batch while this one moves down the stages, and collects the replies of each in
order. Waiting on the pipes together with the processes' sentinels reports a rank that
raised or died at once, naming it; a writer waiting for room in the ring checks the
sentinels of the ranks that have not read yet, and a rank waiting for a call checks
that its parent is alive.

Failure and shutdown: a rank that raises answers with its traceback and the call raises
``WorkerRankError`` naming it; a rank that dies is seen through its sentinel and the call
raises the same, with its exit status. ``shutdown`` asks every rank to stop, then
terminates and finally kills any that did not, so no worker process outlives the executor,
and unlinks the shared memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloom.distributed.shm_broadcast import BroadcastHandle, ReaderGoneError, ShmBroadcastReader, ShmBroadcastWriter
from kvloom.executor.abstract import STEP_METHODS, DistributedExecutor, Results, call_worker, make_worker
from kvloom.processes import describe_exit, main_module_not_reimported
from kvloom.utils import freeze_gc_heap

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

logger = logging.getLogger(__name__)

#: ``KVLOOM_DIST_TIMEOUT_S``: seconds a collective may wait for the other ranks before it
#: raises (torch.distributed's ``init_process_group(timeout=...)``).
DIST_TIMEOUT_ENV = "KVLOOM_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 600.0
#: Seconds a rank gets to stop after the shutdown call, then after SIGTERM, before SIGKILL.
SHUTDOWN_GRACE_S = 5.0
#: The broadcast ring: chunks, and bytes per chunk (a call longer than a chunk, less 8
#: bytes, goes through the pipes). 8 chunks hold more calls than the engine core keeps in
#: flight (pipeline parallelism's micro-batches, async scheduling's one step ahead).
MQ_CHUNKS = 8
MQ_CHUNK_BYTES = 4 * 1024 * 1024


class WorkerRankError(RuntimeError):
    """A worker rank failed (raised or died); ``rank`` names it (its global rank: pipeline
    stage ``rank // tensor_parallel_size``)."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(f"worker rank {rank} {message}")


def seconds_from_env(name: str, default: float) -> float:
    """The positive number of seconds in environment variable ``name`` (``default`` if
    unset); anything else is an error naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds > 0")
    return seconds


def dist_timeout_s() -> float:
    return seconds_from_env(DIST_TIMEOUT_ENV, DEFAULT_DIST_TIMEOUT_S)


@dataclass
class _Rank:
    rank: int
    process: Any  # multiprocessing.Process of the spawn context
    conn: multiprocessing.connection.Connection


class MultiprocExecutor(DistributedExecutor):
    """One spawned worker process per rank; step results from the output rank."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from kvloom.logger import parent_logging

        parallel = config.parallel
        self._ranks: list[_Rank] = []
        self._closed = False
        self._mq: ShmBroadcastWriter | None = None
        self._seq = 0
        # Replies that arrived for a call other than the one being collected, kept for the
        # steps still in flight (``_awaited``): (rank, seq) -> (status, value).
        self._early: dict[tuple[int, int], tuple[str, Any]] = {}
        self._awaited: set[int] = set()
        # A FileStore in a private directory: no port to pick, nothing left behind.
        self._store_dir = tempfile.mkdtemp(prefix="kvloom-tp-")
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        backend = config.device.platform.dist_backend
        timeout_s = dist_timeout_s()
        level, fmt = parent_logging()
        spawn = multiprocessing.get_context("spawn")
        try:
            pipes = [spawn.Pipe(duplex=True) for _ in range(self.world_size)]
            # The ranks' pipes carry the calls too long for a chunk.
            self._mq = ShmBroadcastWriter(
                self.world_size, MQ_CHUNKS, MQ_CHUNK_BYTES, overflow=[parent_end for parent_end, _ in pipes]
            )
            for rank, (parent_end, child_end) in enumerate(pipes):
                process = spawn.Process(
                    target=run_worker,
                    name=f"kvloom-tp-worker-{rank}",
                    kwargs={
                        "config": config, "rank": rank, "world_size": self.world_size, "backend": backend,
                        "init_method": init_method, "timeout_s": timeout_s, "conn": child_end,
                        "broadcast": self._mq.handle,
                        "tensor_parallel_size": parallel.tensor_parallel_size,
                        "log_level": level, "log_format": fmt,
                        "env": config.device.platform.tensor_parallel_env(rank, self.world_size),
                    },
                    # Daemonic: the processes end with the engine core's process.
                    daemon=True,
                )
                with main_module_not_reimported():
                    process.start()
                child_end.close()
                self._ranks.append(_Rank(rank, process, parent_end))
            logger.info(
                "Started %d worker processes (pids %s), backend %s",
                self.world_size, ", ".join(str(r.process.pid) for r in self._ranks), backend,
            )  # fmt: skip
            self.collective_rpc("init_device")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, in rank order."""
        return [r.process.pid for r in self._ranks]

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._collect(self._send(method, args), method)

    def launch(self, method: str, args: tuple[Any, ...]) -> Results:
        seq = self._send(method, args)
        self._awaited.add(seq)  # its replies are kept if another call's collector reads them
        return lambda: self._collect(seq, method)

    def _send(self, method: str, args: tuple[Any, ...]) -> int:
        """Write call ``method(*args)`` to every rank; its sequence number."""
        if self._closed:
            raise RuntimeError(f"the multiprocess executor is shut down (called {method})")
        # Calls are numbered: a reply left over from a call that failed on another rank
        # (raised before every rank answered) is recognised and dropped.
        self._seq += 1
        seq = self._seq
        payload = pickle.dumps((seq, method, args), protocol=pickle.HIGHEST_PROTOCOL)
        assert self._mq is not None
        try:
            self._mq.enqueue(payload, alive=lambda lagging: self._check_alive(lagging, method))
        except ReaderGoneError as e:
            raise self._dead(self._ranks[e.reader], method) from None
        return seq

    def _check_alive(self, ranks: list[int], method: str) -> None:
        """Raise for the first of ``ranks`` whose process has ended (the ring is full and
        waits for them)."""
        for rank in ranks:
            r = self._ranks[rank]
            if r.process.exitcode is not None:
                raise self._dead(r, method)

    def _collect(self, seq: int, method: str) -> list[Any]:
        """Every rank's reply to call ``seq``, in rank order; a rank that raised or died
        raises ``WorkerRankError`` naming it."""
        self._awaited.discard(seq)
        results: list[Any] = [None] * self.world_size
        pending = {r.conn: r for r in self._ranks}
        for r in self._ranks:
            early = self._early.pop((r.rank, seq), None)
            if early is not None:
                del pending[r.conn]
                if early[0] == "error":
                    raise WorkerRankError(r.rank, f"(pid {r.process.pid}) raised in {method}:\n{early[1]}")
                results[r.rank] = early[1]
        sentinels = {r.process.sentinel: r for r in self._ranks}
        while pending:
            waiting = [*pending, *(s for s, r in sentinels.items() if r.conn in pending)]
            for ready in multiprocessing.connection.wait(waiting):
                if ready in pending:
                    r = pending[ready]
                    try:
                        reply_seq, status, value = r.conn.recv()
                    except (EOFError, OSError):
                        raise self._dead(r, method) from None
                    if reply_seq != seq:
                        if reply_seq in self._awaited:  # a step in flight: its collector takes it later
                            self._early[(r.rank, reply_seq)] = (status, value)
                        continue  # else a stale reply: this rank's answer to this call is still to come
                    del pending[ready]
                    if status == "error":
                        raise WorkerRankError(r.rank, f"(pid {r.process.pid}) raised in {method}:\n{value}")
                    results[r.rank] = value
                elif sentinels[ready].conn in pending and not sentinels[ready].conn.poll():
                    raise self._dead(sentinels[ready], method)
        return results

    def _dead(self, r: _Rank, method: str) -> WorkerRankError:
        r.process.join(timeout=1.0)
        return WorkerRankError(r.rank, f"(pid {r.process.pid}) {describe_exit(r.process.exitcode)} during {method}")

    def _all_dead_check(self, lagging: list[int]) -> None:
        """Stop waiting to deliver the shutdown call once every rank it waits for has ended."""
        if all(self._ranks[rank].process.exitcode is not None for rank in lagging):
            raise WorkerRankError(lagging[0], "ended before the shutdown call")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._mq is not None and self._ranks:
            payload = pickle.dumps((-1, "shutdown", ()))
            try:
                # Bounded: a rank stuck in a collective or dead is terminated below.
                self._mq.enqueue(payload, timeout=SHUTDOWN_GRACE_S, alive=self._all_dead_check)
            except (TimeoutError, ReaderGoneError, WorkerRankError) as e:
                logger.debug("shutdown call not delivered to every rank: %s", e)
        for stop in (None, "terminate", "kill"):
            for r in self._ranks:
                if stop is not None and r.process.is_alive():
                    getattr(r.process, stop)()
            for r in self._ranks:
                r.process.join(timeout=SHUTDOWN_GRACE_S)
            if not any(r.process.is_alive() for r in self._ranks):
                break
        for r in self._ranks:
            r.conn.close()
        if self._mq is not None:
            self._mq.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def run_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    conn: multiprocessing.connection.Connection,
    broadcast: BroadcastHandle,
    log_level: int | None = None,
    log_format: str | None = None,
    env: dict[str, str] | None = None,
    tensor_parallel_size: int | None = None,
) -> None:
    """A worker process's busy loop: join the process group, build the worker, then
    answer calls read from the broadcast queue ``broadcast`` (reader ``rank``; ``conn``
    carries the calls too long for its chunks, and the replies) until ``shutdown`` or the
    parent process ends. ``env``: the platform's ``tensor_parallel_env`` for this rank,
    set before anything else."""
    from kvloom import plugins
    from kvloom.distributed import parallel_state
    from kvloom.logger import dump_stacks_on_sigusr1, setup_child_logging

    os.environ.update(env or {})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    dump_stacks_on_sigusr1()
    if log_level is not None:
        setup_child_logging(log_level, log_format, f"(TPWorker rank={rank} pid={os.getpid()}) ")
    worker: Any = None
    failure: str | None = None
    queue = ShmBroadcastReader(broadcast, rank, overflow=conn)
    orphaned = False
    parent = multiprocessing.parent_process()

    def parent_alive() -> None:
        if parent is not None and not parent.is_alive():
            raise EOFError("the parent process ended")

    try:
        plugins.load_plugins()
        parallel_state.init_tensor_parallel(rank, world_size, backend, init_method, timeout_s, tensor_parallel_size)
        worker = make_worker(config)
    except BaseException:
        failure = traceback.format_exc()
    while True:
        try:
            seq, method, args = queue.dequeue(alive=parent_alive, decode=pickle.loads)
        except (EOFError, OSError):
            logger.warning("The engine core is gone; tensor-parallel rank %d stops", rank)
            orphaned = True
            break
        if method == "shutdown":
            break
        if failure is not None:
            conn.send((seq, "error", failure))
            continue
        try:
            result = call_worker(worker, method, args)
        except BaseException:
            conn.send((seq, "error", traceback.format_exc()))
            continue
        if method == "compile_or_warm_up_model":
            # Start-up is over (model, cache, graphs): as in the engine core's process,
            # its state leaves the full garbage collections' way.
            freeze_gc_heap()
        # A step's output leaves the output rank only: the other ranks' are the same tokens
        # (tensor parallelism) or empty (earlier pipeline stages).
        output = rank == parallel_state.output_rank(parallel_state.tp_world_size(), parallel_state.pp_world_size())
        conn.send((seq, "ok", None if not output and method in STEP_METHODS else result))
    # Nobody else will unlink the ring if the engine core died without shutting down.
    queue.close(unlink=orphaned)
    try:
        if worker is not None:
            worker.shutdown()
    finally:
        parallel_state.destroy_tensor_parallel()
