"""benchmarks/bench_piecewise_cpu.py at a tiny size (2 layers, FX pieces), so a later
measurement cannot fail on a script error: every timing is there and the stand-in
graphs were really captured and replayed (3 pieces, the wrapper's replay measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_piecewise_cpu.py"


def test_benchmark_script_runs_end_to_end(tmp_path):
    env = {**os.environ, "KVLOOM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--num-layers", "2", "--batch", "4", "--calls", "2",
         "--repeats", "1", "--no-inductor", "--label", "t"],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((tmp_path / "cpu_piecewise_2layers_t.json").read_text())
    assert result["num_pieces"] == 3
    timings = result["forward_us"]
    assert set(timings) == {"eager", "compiled", "replay", "replay_noattn", "replay_noattn_no_dynamo"}
    assert all(v > 0 for v in timings.values())
    parts = result["parts_us"]
    assert parts["piece_num_args"] > 1 and all(v > 0 for v in parts.values())
