"""``SchedulerInterface`` is the whole contract the engine core uses: ``Scheduler``
implements every method of it, and ``EngineCore`` calls nothing else on its scheduler."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvloom.engine.core as engine_core
from kvloom.scheduler.interface import SchedulerInterface
from kvloom.scheduler.scheduler import Scheduler


def test_scheduler_implements_the_interface() -> None:
    assert issubclass(Scheduler, SchedulerInterface)
    assert not Scheduler.__abstractmethods__


def test_every_method_of_the_interface_is_documented() -> None:
    undocumented = [name for name, fn in vars(SchedulerInterface).items()
                    if inspect.isfunction(fn) and not (fn.__doc__ or "").strip()]  # fmt: skip
    assert not undocumented


def test_the_engine_core_calls_only_the_interface() -> None:
    tree = ast.parse(Path(engine_core.__file__).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "scheduler"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    assert {"schedule", "update_from_output", "add_request"} <= used  # the reader sees the calls
    assert used <= set(SchedulerInterface.__abstractmethods__), sorted(used - SchedulerInterface.__abstractmethods__)
