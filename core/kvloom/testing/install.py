"""A plugin distribution in a test, the way users get it: pip-installed, then run by
``kvloom`` in a subprocess.

``install_distribution(source, workdir)`` pip-installs your project into a directory of
its own, ``plugin_env([site])`` is the environment that puts that directory on
``PYTHONPATH`` for a ``kvloom`` subprocess (``subprocess.run([sys.executable, "-m",
"kvloom", ...], env=plugin_env([site]))``), and ``KvloomServer`` runs ``kvloom serve`` with
it until the block ends::

    site = install_distribution(Path(__file__).parents[1], tmp_path)
    with KvloomServer([str(model_dir), "--max-model-len", "128"], tmp_path, [site]) as server:
        assert server.get("/v1/models").status_code == 200

A run through the installed distribution proves what an in-process test cannot: the entry
point, the ``KVLOOM_PLUGIN_API`` declaration and the loading.
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
from typing import Any

import httpx

__all__ = ["STARTUP_TIMEOUT_S", "KvloomServer", "install_distribution", "plugin_env"]

STARTUP_TIMEOUT_S = 240
"""How long ``KvloomServer`` waits for ``GET /health`` to answer 200, in seconds."""


def install_distribution(source: str | Path, workdir: str | Path) -> Path:
    """``pip install --no-deps --target DIR source`` into a fresh ``DIR`` under ``workdir``,
    and return ``DIR`` (the directory to put on ``PYTHONPATH``: ``plugin_env``). pip builds
    from a copy of ``source`` (so no ``build/`` or ``*.egg-info`` lands in your project),
    offline and without build isolation: the build backend your ``pyproject.toml`` names
    (e.g. setuptools) must be installed in the running environment. A failure is an
    ``AssertionError`` with pip's output."""
    source, workdir = Path(source), Path(workdir)
    build_copy = workdir / f"src-{source.name}"
    shutil.copytree(source, build_copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = workdir / f"site-{source.name}"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(target), str(build_copy)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install {source} failed:\n{done.stdout}\n{done.stderr}"
    return target


def plugin_env(site_dirs: Sequence[str | Path], **extra: str) -> dict[str, str]:
    """The environment of a ``kvloom`` subprocess that sees the distributions installed in
    ``site_dirs``: this process's environment without its ``KVLOOM_*`` variables (so the
    caller's ``KVLOOM_PLUGINS`` or ``KVLOOM_PLATFORM`` do not leak in), ``site_dirs`` first
    on ``PYTHONPATH``, then ``extra`` (``KVLOOM_PLATFORM="cpu"``, your plugin's variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    paths = [str(p) for p in site_dirs] + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


class KvloomServer:
    """``kvloom serve ARGS`` in a subprocess on a free local port, for a ``with`` block.

    ``KvloomServer(args, workdir, site_dirs=(), access_log=False, command=None, **env)``:
    ``args`` are ``kvloom serve``'s arguments (the model first; ``--host``/``--port`` are added, and
    ``--disable-uvicorn-access-log`` unless ``access_log``), ``workdir`` receives the
    server's log (``server-PORT.log``), and the environment is ``plugin_env(site_dirs,
    **env)``. Entering the block waits until ``GET /health`` answers 200 (at most
    ``STARTUP_TIMEOUT_S``), raising ``RuntimeError`` with the log's end if the server exits
    or never gets healthy; leaving it stops the server (SIGINT, then SIGKILL after 30 s).
    ``url`` is ``http://127.0.0.1:PORT``; ``process`` the ``subprocess.Popen``. ``command``:
    what runs before ``args`` instead of ``python -m kvloom serve`` (another way to start
    the same server)."""

    def __init__(
        self,
        args: Sequence[str],
        workdir: str | Path,
        site_dirs: Sequence[str | Path] = (),
        access_log: bool = False,
        command: Sequence[str] | None = None,
        **env: str,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(workdir) / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        command = command or [sys.executable, "-m", "kvloom", "serve"]
        cmd = [*command, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        if not access_log:
            cmd.append("--disable-uvicorn-access-log")
        self.process = subprocess.Popen(cmd, env=plugin_env(site_dirs, **env), stdout=self._log,
                                        stderr=subprocess.STDOUT)  # fmt: skip

    def log(self) -> str:
        """Everything the server printed so far (stdout and stderr)."""
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
        """Stop the server (SIGINT: a graceful shutdown; SIGKILL if it takes over 30 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def post(self, path: str, body: Any, timeout: float = 120) -> httpx.Response:
        """``POST path`` with ``body`` as JSON."""
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> httpx.Response:
        """``GET path``."""
        return httpx.get(self.url + path, timeout=timeout)
