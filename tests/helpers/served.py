"""Reading a running `kvloom serve` from outside: its processes (from the log lines each
process prefixes with its role and pid), its /metrics, and that it left nothing behind;
and the tiny model with a long context that the process tests serve (long streams, to
still be running when a process is killed)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvloom.testing.install import KvloomServer
from kvloom.testing.models import make_tiny_model
from tests.helpers.engine_faults import descendant_pids, is_running, wait_gone

#: The context of ``long_context_model`` and of the servers ``serve_args`` describes.
LONG_CONTEXT = 4096


def long_context_model(out_dir: Path) -> Path:
    """The tiny random Llama with a ``LONG_CONTEXT``-token context, saved in ``out_dir``."""
    return make_tiny_model("llama", out_dir, max_position_embeddings=LONG_CONTEXT)


def serve_args(model_dir: Path, *extra: str) -> list[str]:
    """``kvloom serve`` arguments for ``long_context_model`` (fp32, 32 MiB of KV cache)."""
    return [str(model_dir), "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", str(LONG_CONTEXT),
            *extra]  # fmt: skip


def pids_in_log(server: KvloomServer, role: str) -> dict[int, int]:
    """{index: pid} of the processes whose log lines say ``(role_index pid=...)``
    (``EngineCore``, ``APIServer``)."""
    return {int(i): int(pid) for i, pid in re.findall(rf"\({role}_(\d+) pid=(\d+)\)", server.log())}


def engine_core_pid(server: KvloomServer, index: int = 0) -> int:
    """Engine core ``index``'s process (found by its log lines), checked to run under the
    server: its child when spawned, its grandchild when forked from the fork server."""
    pid = pids_in_log(server, "EngineCore").get(index)
    assert pid is not None, f"no log line of engine core {index} in the server's log"
    under = descendant_pids(server.process.pid)
    assert pid in under, f"engine core {index} (pid {pid}) is not under the server (pid {server.process.pid}): {under}"
    return pid


def metrics(server: KvloomServer) -> dict[tuple[str, tuple], float]:
    """Every sample of ``GET /metrics`` (a new connection: with several API servers, any
    one may answer): {(name, sorted labels): value}."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(values: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


def no_process_left(server: KvloomServer, children: list[int], timeout: float = 15) -> None:
    """The server has exited and so has every process it had started (each gone within
    ``timeout`` seconds)."""
    assert not is_running(server.process.pid)
    left = [pid for pid in children if not wait_gone(pid, timeout=timeout)]
    assert not left, f"processes left behind: {left}"
