"""Fixtures shared by kvloom's tests.

Helpers that are not fixtures (tiny HF models, the fake engine of the server tests, the
plugin installer, the reference attention backend) live in ``tests.helpers``; each test
imports what it uses from there. GPU-only tests skip themselves without a CUDA device
(``tests/gpu/run.sh`` runs them on the GPU machine).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvloom import plugins


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's plugins loaded anew, with every installed plugin (no
    ``KVLOOM_PLUGINS`` allowlist) and the default platform resolution (no
    ``KVLOOM_PLATFORM``); forgotten again afterwards."""
    for var in ("KVLOOM_PLUGINS", "KVLOOM_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()
