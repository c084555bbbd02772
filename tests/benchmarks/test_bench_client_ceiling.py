"""``benchmarks/bench_client_ceiling.py`` end to end with a tiny workload (so the script cannot rot before its next
use): both clients read every event of the fake server, and the markdown holds both rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_client_ceiling.py"


def test_both_clients_read_the_fake_server(tmp_path: Path) -> None:
    out = tmp_path / "ceiling.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--requests", "8", "--concurrency", "4", "--events", "16",
                          "--repeats", "1", "--markdown", str(out)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| kvloom |", "| httpx |"))]
    assert len(rows) == 2 and all("| 8 | 128 |" in row for row in rows)
