"""``RayDistributedExecutor``: one Ray actor per rank (tensor- x pipeline-parallel), on the nodes of a Ray cluster.

``--distributed-executor-backend ray``. Ray places the ranks; torch.distributed still
carries the collectives (the platform's ``dist_backend``: NCCL on CUDA, gloo on the CPU),
exactly as under ``mp``. Ray is an optional dependency (``pip install ray`` or
``kvloom[ray]``); this module imports it only when an executor is built.

Start-up:

1. Ray: the cluster this process is already connected to (``ray.init`` done by the
   caller), else the one ``RAY_ADDRESS`` names or the one running on this machine
   (``ray start --head``; ``address="auto"``), else a local instance this executor starts
   and stops with itself.
2. A placement group of ``tensor_parallel_size x pipeline_parallel_size`` bundles of one ``Platform.ray_device_key``
   each ("GPU" on CUDA, "CPU" on the CPU; an out-of-tree platform names its own), packed
   onto as few nodes as possible. Not placeable within ``KVLOOM_RAY_PLACEMENT_TIMEOUT_S``
   seconds (default 300) is an error listing what the cluster has free.
3. One actor per bundle; the actor of bundle ``r`` is rank ``r``: pipeline stage
   ``r // tensor_parallel_size``, tensor-parallel rank ``r % tensor_parallel_size`` (the
   layout of ``mp``, ``kvloom.distributed.parallel_state``). Ray makes only its
   bundle's device visible to it, so every rank runs on device index 0 of its process
   (``parallel_state.set_device_index(0)``). It gets the engine process's ``KVLOOM_*``
   environment variables (Ray starts actors with its raylet's environment) and then the
   platform's ``tensor_parallel_env`` for its rank.
4. Rank 0's actor picks a free TCP port on its node; every rank joins the process group at
   ``tcp://<rank 0's node IP>:<port>`` with ``KVLOOM_DIST_TIMEOUT_S`` bounding each
   collective, then builds the platform's worker.

Calls: ``collective_rpc`` stores the call's arguments in Ray's object store once
(``ray.put``) and calls every actor with the reference; it waits on the replies together
and raises at the first failure: a rank that raised (``WorkerRankError`` with its
traceback) or whose actor died (its node or process gone; Ray reports it at once, so the
call never waits on the survivors, who may be blocked in a collective). Step outputs come
from the output rank only (the last stage's tensor-parallel rank 0; rank 0 without
pipeline parallelism), as under ``mp``.

Steps: ``execute_model`` submits the step to every actor and returns at once with
the calls' object refs; ``get_output()`` gathers them (so a failure of any rank surfaces,
naming it) and returns the output rank's. Ray runs an actor's calls from one caller in
the order they were submitted, so under pipeline parallelism the engine core's batch
queue really has several micro-batches in flight: stage 0 runs micro-batch n+1 while
stage 1 runs n. (Under async scheduling, step n+1 is likewise queued behind step n.)

Shutdown: each rank is asked to leave its process group (a few seconds at most), then
every actor is killed and the placement group removed, so no actor and no reserved
resource outlives the executor; a Ray instance the executor started is stopped. The
actors are owned by the process that created them: if it dies, Ray ends them too.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from kvloom.executor.abstract import STEP_METHODS, DistributedExecutor, Results, call_worker, make_worker
from kvloom.executor.multiproc import (
    SHUTDOWN_GRACE_S,
    WorkerRankError,
    dist_timeout_s,
    seconds_from_env,
)

if TYPE_CHECKING:
    from types import ModuleType

    from kvloom.config import EngineConfig
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install ray (or pip install 'kvloom[ray]')"
#: ``KVLOOM_RAY_PLACEMENT_TIMEOUT_S``: seconds the placement group may take to be placed.
PLACEMENT_TIMEOUT_ENV = "KVLOOM_RAY_PLACEMENT_TIMEOUT_S"
DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
#: Environment variables of the engine's process that its actors get too.
FORWARDED_ENV_PREFIX = "KVLOOM_"
#: Seconds a call that failed on one rank waits to see whether another rank died (the cause).
DEATH_GRACE_S = 2.0


def import_ray() -> ModuleType:
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"distributed_executor_backend: 'ray' needs Ray, which is not installed ({exc}); {INSTALL_HINT}"
        ) from exc
    return ray


def placement_timeout_s() -> float:
    return seconds_from_env(PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S)


def actor_resources(device_key: str) -> dict[str, Any]:
    """The ``ray.remote`` options of a rank's actor that take its bundle's one device
    (Ray names CPUs and GPUs by keyword, any other resource in ``resources``)."""
    if device_key == "CPU":
        return {"num_cpus": 1}
    if device_key == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {device_key: 1}}


class RankActor:
    """The body of one rank's Ray actor (made remote by the executor): it holds the
    platform's worker and runs the methods ``collective_rpc`` names."""

    def __init__(self, rank: int, platform: type[Platform], world_size: int, env: dict[str, str],
                 log_level: int | None, log_format: str | None) -> None:  # fmt: skip
        from kvloom.logger import setup_child_logging

        self.rank = rank
        # Ray starts actors with the environment of its node's raylet, not the engine's:
        # the engine's KVLOOM_* settings (plugins, threads, ...) come along explicitly.
        # Then the platform's per-rank environment (e.g. a CPU rank's share of the
        # threads), computed on the actor's own node, before the worker is built.
        os.environ.update(env)
        os.environ.update(platform.tensor_parallel_env(rank, world_size))
        if log_level is not None:
            setup_child_logging(log_level, log_format, f"(RayWorker rank={rank} pid={os.getpid()}) ")
        self.worker: Any = None
        self.output_rank: int | None = None  # set by init_worker

    def where(self) -> tuple[str, int]:
        """This actor's node IP address and process id."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0: the process group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_worker(self, config: EngineConfig, backend: str, init_method: str, timeout_s: float) -> None:
        """Join the process group (and this stage's tensor-parallel subgroup), build the
        platform's worker and initialise its device."""
        from kvloom import plugins
        from kvloom.distributed import parallel_state

        plugins.load_plugins()
        parallel_state.set_device_index(0)  # Ray shows this actor its bundle's device only
        parallel = config.parallel
        parallel_state.init_tensor_parallel(self.rank, parallel.world_size, backend, init_method, timeout_s,
                                            parallel.tensor_parallel_size)  # fmt: skip
        self.output_rank = parallel_state.output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.worker = make_worker(config)
        self.worker.init_device()

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        result = call_worker(self.worker, method, args)
        # A step's output leaves the output rank only: the other ranks' are the same tokens
        # (tensor parallelism) or empty (earlier pipeline stages).
        return None if self.rank != self.output_rank and method in STEP_METHODS else result

    def shutdown(self) -> None:
        from kvloom.distributed import parallel_state

        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            parallel_state.destroy_tensor_parallel()


class RayDistributedExecutor(DistributedExecutor):
    """One Ray actor per rank (tensor-parallel size x pipeline-parallel size), placed with
    a placement group; results from the output rank."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from kvloom.logger import parent_logging

        self._ray = ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        platform = config.device.platform
        device_key = platform.ray_device_key
        if device_key is None:
            raise ValueError(f"distributed_executor_backend: 'ray' is not supported by the {platform.name} platform "
                             "(it names no Ray resource: Platform.ray_device_key); allowed: mp")  # fmt: skip
        parallel = config.parallel
        self._closed = False
        self._actors: list[Any] = []
        self._where: list[tuple[str, int]] = []
        self._pg: Any = None
        self._owns_ray = self._connect()
        try:
            bundles = [{device_key: 1.0} for _ in range(self.world_size)]
            # PACK: the ranks of one stage (adjacent bundles) share a node where they fit.
            self._pg = placement_group(bundles, strategy="PACK", name=f"kvloom-ranks-{os.getpid()}-{id(self)}")
            timeout = placement_timeout_s()
            ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
            if not ready:
                field = "tensor_parallel_size" if parallel.pipeline_parallel_size == 1 else (
                    f"tensor_parallel_size x pipeline_parallel_size ({parallel.tensor_parallel_size} x "
                    f"{parallel.pipeline_parallel_size})")  # fmt: skip
                raise RuntimeError(
                    f"{field}: {self.world_size} ranks need {self.world_size} x {{'{device_key}': 1}} "
                    f"on the Ray cluster, which could not be placed within {timeout:g} s ({PLACEMENT_TIMEOUT_ENV}); "
                    f"available now: {ray.available_resources()}"
                )
            level, fmt = parent_logging()
            actor_cls = ray.remote(RankActor)
            env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIX)}
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True,
                )  # fmt: skip
                actor = actor_cls.options(
                    max_restarts=0, scheduling_strategy=strategy, **actor_resources(device_key)
                ).remote(rank, platform, self.world_size, env, level, fmt)
                self._actors.append(actor)
            self._where = self._gather("where", [a.where.remote() for a in self._actors])
            master_ip = self._where[0][0]
            port = self._gather("free_port", [self._actors[0].free_port.remote()])[0]
            init_method = f"tcp://{_host(master_ip)}:{port}"
            backend = platform.dist_backend
            logger.info(
                "Started %d Ray actors, %d stage(s) of %d tensor-parallel rank(s) (%s), backend %s, rendezvous %s",
                self.world_size, parallel.pipeline_parallel_size, parallel.tensor_parallel_size, ", ".join(f"rank {r}: pid {pid} on {ip}" for r, (ip, pid) in enumerate(self._where)),
                backend, init_method,
            )  # fmt: skip
            timeout_s = dist_timeout_s()
            self._gather("init_device", [a.init_worker.remote(config, backend, init_method, timeout_s)
                                         for a in self._actors])  # fmt: skip
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> bool:
        """Connect to Ray (see the module docstring); whether this executor started it."""
        ray = self._ray
        if ray.is_initialized():
            return False
        # The actors' log lines come to this process; Ray's own only from warnings up.
        kwargs: dict[str, Any] = {"log_to_driver": True, "logging_level": logging.WARNING}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**kwargs)  # the cluster RAY_ADDRESS names
            return False
        try:
            ray.init(address="auto", **kwargs)  # a cluster running on this machine (ray start --head)
            logger.info("Connected to the running Ray cluster")
            return False
        except ConnectionError:
            pass
        ray.init(include_dashboard=False, **kwargs)
        logger.info("Started a local Ray instance: %s", ray.cluster_resources())
        return True

    @property
    def worker_pids(self) -> list[int]:
        """The actors' process ids, in rank order (on their nodes)."""
        return [pid for _, pid in self._where]

    def _describe(self, rank: int) -> str:
        if rank < len(self._where):
            ip, pid = self._where[rank]
            return f"(Ray actor, pid {pid} on {ip})"
        return "(Ray actor)"

    def _gather(self, method: str, refs: list[Any]) -> list[Any]:
        """The values of ``refs`` (one per rank, rank order); raises ``WorkerRankError`` at
        the first rank that raised or died, without waiting for the others to finish."""
        ray = self._ray
        from ray.exceptions import RayActorError, RayTaskError

        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    raise self._died(rank, method, exc) from None
                except RayTaskError as exc:
                    # A rank whose peer died fails in its collective ("connection reset")
                    # at about the moment Ray reports the death: name the dead rank, the
                    # cause, when one is seen within the grace period.
                    if pending:
                        late, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
                        for other in late:
                            try:
                                ray.get(other)
                            except RayActorError as death:
                                raise self._died(pending[other], method, death) from None
                            except RayTaskError:
                                pass
                    raise WorkerRankError(rank, f"{self._describe(rank)} raised in {method}:\n{exc}") from None
        return results

    def _died(self, rank: int, method: str, exc: BaseException) -> WorkerRankError:
        cause = str(exc).strip().splitlines()
        return WorkerRankError(
            rank, f"{self._describe(rank)} died during {method}: {cause[0] if cause else type(exc).__name__}"
        )

    def _submit(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Call ``method(*args)`` on every actor without waiting; the calls' refs, rank order."""
        if self._closed:
            raise RuntimeError(f"the Ray executor is shut down (called {method})")
        # One copy of the arguments in the object store, read by every rank.
        payload = self._ray.put(args) if args else ()
        return [a.call.remote(method, payload) for a in self._actors]

    def launch(self, method: str, args: tuple[Any, ...]) -> Results:
        refs = self._submit(method, args)
        return lambda: self._gather(method, refs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        from ray.util.placement_group import remove_placement_group

        if self._actors:
            # Leave the process group cleanly where possible; a rank blocked in a collective
            # (its peer died) does not answer and is killed below.
            refs = [a.shutdown.remote() for a in self._actors]
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_GRACE_S)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()


def _host(ip: str) -> str:
    """``ip`` as the host part of a URL (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip else ip
