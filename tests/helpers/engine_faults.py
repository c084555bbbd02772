"""Engine cores that fail on purpose, and process helpers for the tests of the engine core
process.

The faults ride in the ``EngineConfig``: ``with_platform(config, StepFailsPlatform)``
swaps the resolved platform for a subclass of the CPU platform whose worker fails. The
class pickles by reference (this module is importable in the engine core process), so
the failure happens where the engine core runs, in its own process or in this one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvloom_platform_cpu.platform import CpuPlatform
from kvloom_platform_cpu.worker import CpuWorker

from kvloom.config import EngineConfig

#: The message of the step failure of ``StepFailsPlatform``.
STEP_FAILURE = "GPU on fire"


class StepFailsWorker(CpuWorker):
    """Fails its third step, with an error no single request caused."""

    def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            raise RuntimeError(STEP_FAILURE)
        return super().execute_model(scheduler_output)


class StepFailsPlatform(CpuPlatform):
    @classmethod
    def get_worker_cls(cls) -> type:
        return StepFailsWorker


class ExitsAtStartupWorker(CpuWorker):
    """Its process vanishes while the engine starts (as when the OS kills it), with no
    error to report."""

    def init_device(self) -> None:
        os._exit(3)


class ExitsAtStartupPlatform(CpuPlatform):
    @classmethod
    def get_worker_cls(cls) -> type:
        return ExitsAtStartupWorker


def with_platform(config: EngineConfig, platform: type) -> EngineConfig:
    config.device.platform = platform
    return config


# ----------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
    return text[text.rindex(")") + 2 :].split()


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def running_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are live processes."""
    return [p for p in pids if is_running(p)]


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid``."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return children


def descendant_pids(pid: int) -> list[int]:
    """The live processes under ``pid``: its children, theirs, and so on (an engine core
    forked from multiprocessing's fork server is a child of that server, not of the
    process that asked for it)."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in child_pids(p)]
        found += children
        frontier = children
    return found


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.05)
    return not is_running(pid)
