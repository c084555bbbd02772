"""Executors: how the engine core runs its worker(s) (``Executor``, ``get_executor_cls``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvloom.executor.abstract import Executor

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

__all__ = ["Executor", "get_executor_cls"]


def get_executor_cls(config: EngineConfig) -> type[Executor]:
    """The executor of ``config.parallel.distributed_executor_backend`` ("uni", "mp" or "ray")."""
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from kvloom.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from kvloom.executor.ray import RayDistributedExecutor

        return RayDistributedExecutor
    if backend == "uni":
        from kvloom.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    raise ValueError(f"distributed_executor_backend: {backend!r} is not known (allowed: uni, mp, ray)")
