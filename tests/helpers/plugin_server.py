"""Helpers for tests that pip-install a plugin distribution and run `kvloom` with it.

``install_distribution`` pip-installs a source directory into its own ``--target``
directory (from a copy, so no build leftovers land in the repository); ``KvloomServer``
runs ``kvloom serve`` in a subprocess with those directories on PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240


def install_distribution(source: Path, workdir: Path) -> Path:
    """pip install ``source`` into a fresh target directory under ``workdir``; returns it."""
    build_copy = workdir / f"src-{source.name}"
    shutil.copytree(source, build_copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = workdir / f"site-{source.name}"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(target), str(build_copy)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install {source} failed:\n{done.stdout}\n{done.stderr}"
    return target


def plugin_env(site_dirs: Sequence[Path], **extra: str) -> dict[str, str]:
    """The environment of a kvloom subprocess: no inherited KVLOOM_* settings, the
    plugin directories first on PYTHONPATH, ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    paths = [str(p) for p in site_dirs] + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


class KvloomServer:
    """``kvloom serve ARGS`` on a free local port; use as a context manager."""

    def __init__(self, args: Sequence[str], workdir: Path, site_dirs: Sequence[Path] = (), **env: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "kvloom.entrypoints.cli.main", "serve", *args,
               "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log"]  # fmt: skip
        self.process = subprocess.Popen(cmd, env=plugin_env(site_dirs, **env), stdout=self._log,
                                        stderr=subprocess.STDOUT)  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text()

    def __enter__(self) -> "KvloomServer":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvloom serve exited with {self.process.returncode}:\n{self.log()[-5000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvloom serve not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()[-5000:]}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)
