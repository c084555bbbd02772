"""Helpers for tests that pip-install a plugin distribution and run `kvloom` with it:
``kvloom.testing.install``'s (shipped with kvloom for plugin authors), plus ``REPO``,
the repository root, where kvloom's own tests find the first-party distributions."""

from __future__ import annotations

from pathlib import Path

from kvloom.testing.install import STARTUP_TIMEOUT_S, KvloomServer, install_distribution, plugin_env

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "STARTUP_TIMEOUT_S", "KvloomServer", "install_distribution", "plugin_env"]
