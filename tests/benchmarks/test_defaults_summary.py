"""benchmarks/peers/defaults_summary.py (tests/gpu/run.sh stage defaults): the offline and served results of kvloom at
its defaults become one table and summary.json; a missing or failed run is reported and fails the stage."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "defaults_summary.py"
spec = importlib.util.spec_from_file_location("peers_defaults_summary", SCRIPT)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def _write(folder: Path) -> None:
    offline = {"engine": "kvloom", "settings": [], "init_s": 41.0,
               "runs": [{"wall_s": 6.0, "output_tokens": 133_966, "output_tok_s": 22_000.0}]}  # fmt: skip
    run = {"client": "kvloom", "output_throughput": 12_900.0, "ttft_ms": {"median": 150.0},
           "tpot_ms": {"median": 3.7}, "itl_ms": {"median": 3.6, "p99": 12.5}, "prefix_cache": {"hit_rate": 0.0}}  # fmt: skip
    serving = {"engine": "kvloom", "settings": [], "startup_s": 63.0, "runs": {"64": {"num_prompts": 500, "kvloom": [run]}}}
    (folder / "kvloom_offline.json").write_text(json.dumps(offline))
    (folder / "kvloom_serving.json").write_text(json.dumps(serving))


def test_table_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    _write(tmp_path)
    monkeypatch.setattr(sys, "argv", ["defaults_summary.py", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        summary.main()
    assert done.value.code == 0
    table = capsys.readouterr().out
    assert "| offline (nano-vllm, 256 seqs) | 22,000 | - | - | - | - | 41 |" in table
    assert "| served, concurrency 64, 500 prompts (kvloom bench serve) | 12,900 | 150.0 | 3.70 | 3.60 | 12.50 | 63 |" in table
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["output_tok_s"] for r in rows] == [22_000.0, 12_900.0]


def test_missing_or_failed_runs_fail(tmp_path: Path) -> None:
    rows = summary.summarise(tmp_path)
    assert [r["error"] for r in rows] == ["kvloom_offline.json missing", "kvloom_serving.json missing"]
    _write(tmp_path)
    (tmp_path / "kvloom_serving.json").write_text(json.dumps({"startup_s": None, "error": "server exited with 1"}))
    rows = summary.summarise(tmp_path)
    assert rows[0]["error"] is None and rows[1]["error"] == "server exited with 1"
