"""The engine from a test: what it would resolve, a platform's worker as the engine builds
it, and the ``kvloom`` command in-process.

Both run in this process, so they see what ``kvloom.testing.installed_backend`` and
``kvloom.testing.active_platform`` set up, and a test's ``monkeypatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.entrypoints.cli.main import main
from kvloom.platforms.interface import Platform
from kvloom.platforms.worker import WorkerBase
from kvloom.worker.model_runner import ModelRunner

__all__ = ["ModelRunner", "make_worker", "resolve_engine_config", "run_cli"]


def resolve_engine_config(**engine_args: Any) -> EngineConfig:
    """The ``EngineConfig`` the engine would run with for these ``EngineArgs`` (the keyword
    arguments of ``LLM``: ``model=``, ``dtype=``, ``block_size=``, ...), resolved with this
    process's plugins: the active platform (and its ``check_and_update_config``), the
    selected attention backend and block size, general plugins' config hooks. Loads no
    weights and starts nothing; raises the ``ValueError`` the engine would."""
    return create_engine_config(EngineArgs(**engine_args))


def make_worker(worker_cls: type[WorkerBase], config: EngineConfig, platform: type[Platform] | None = None) -> WorkerBase:
    """``worker_cls`` built as the engine builds a platform's worker: for ``config`` (and
    ``platform``, by default the config's), handed kvloom's model runner class
    (``ModelRunner``, also exported here for tests that spy on it). Its device is not set
    up yet (``init_device``)."""
    return worker_cls(config, platform or config.device.platform, model_runner_cls=ModelRunner)


def run_cli(argv: Sequence[str]) -> int:
    """Run the ``kvloom`` command with ``argv`` (``run_cli(["backends", "--json"])``) in
    this process and return its exit status. What it prints goes to this process's
    stdout and stderr (pytest's ``capsys`` reads it); a usage error exits as argparse
    does (``SystemExit``)."""
    return main(list(argv))
