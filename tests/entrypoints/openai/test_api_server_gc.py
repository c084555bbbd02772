"""The API server process freezes its start-up heap before it serves (kvloom.utils.freeze_gc_heap),
as the engine core process does: the app, the tokenizer and the engine client stay out of the
cyclic GC's full collections that many streams' per-token allocations trigger."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvloom.entrypoints.openai import api_server


class _FakeEngine:
    def on_engine_dead(self, callback: Any) -> None:
        self.callback = callback


class _FakeServer:
    """Stands in for uvicorn.Server: records what the GC had frozen when serving began."""

    frozen_at_serve: int | None = None

    def __init__(self, config: Any) -> None:
        self.config = config

    async def serve(self, sockets: Any = None) -> None:
        _FakeServer.frozen_at_serve = gc.get_freeze_count()


def test_serve_engine_freezes_the_heap_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_server.uvicorn, "Server", _FakeServer)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        status = asyncio.run(api_server.serve_engine(_FakeEngine(), config=object()))  # type: ignore[arg-type]
        assert status == 0
        assert _FakeServer.frozen_at_serve is not None and _FakeServer.frozen_at_serve > 1_000
    finally:
        gc.unfreeze()  # the test process's heap goes back to the normal generations
