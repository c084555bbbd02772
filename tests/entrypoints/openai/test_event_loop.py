"""The API server's event loop: uvloop's when it imports (a dependency on Linux), asyncio's
own when it does not; either way the coroutine's result comes back."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvloom.entrypoints.openai import event_loop


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_runs_the_server_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert event_loop.run(loop_module()).startswith(uvloop.__name__)


def test_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert event_loop.run(loop_module()).startswith("asyncio")
