"""The example stat logger (plugins/examples/stat_logger), pip-installed: `kvloom generate`
builds it, and it writes a JSON line per engine step with the scheduler and iteration stats
of the run (prompt and generated tokens, finished requests, running requests), then the
summary of the engine's last log() when the run ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "kvloom"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(SOURCE, tmp_path_factory.mktemp("example-stat-logger"))


def test_generate_feeds_the_logger(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "stats.jsonl"
    args = ["generate", "--model", str(tiny_model_dir("llama")), "--prompt", "The quick brown fox", "--prompt",
            "Hello world", "--raw", "--json", "--max-tokens", "5", "--dtype", "float32", "--no-disable-log-stats",
            "--log-stats-interval", "3600"]  # fmt: skip
    done = subprocess.run([*CLI, *args], env=plugin_env([site], KVLOOM_STATS_JSONL=str(out)),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    events = [line["event"] for line in lines]
    assert events[:2] == ["init", "engine_initialized"]
    # The interval (an hour) never passed: the one log() is the engine's last, at shutdown, after every record().
    assert events.count("log") == 1 and events[-1] == "log"
    assert lines[0] == {"event": "init", "model": lines[0]["model"], "engine_index": 0}
    assert lines[1]["num_blocks"] > 0 and lines[1]["block_size"] == 16

    records = [line for line in lines if line["event"] == "record"]
    iterations = [r["iteration"] for r in records]
    assert sum(it["num_generation_tokens"] for it in iterations) == sum(len(r["token_ids"]) for r in results)
    assert sum(it["num_prompt_tokens"] for it in iterations) == sum(r["num_prompt_tokens"] for r in results)
    finished = [f for it in iterations for f in it["finished_requests"]]
    assert sorted(f["finish_reason"] for f in finished) == sorted(r["finish_reason"] for r in results)
    assert all(f["e2e_latency"] > 0 and f["max_tokens_param"] == 5 for f in finished)
    assert max(r["scheduler"]["num_running_reqs"] for r in records) == 2
    assert records[-1]["scheduler"]["num_running_reqs"] == 0


def test_silent_without_its_variable(site: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(SOURCE))
    monkeypatch.delenv("KVLOOM_STATS_JSONL", raising=False)
    monkeypatch.chdir(tmp_path)
    from types import SimpleNamespace

    from kvloom_example_stat_logger import JsonLinesStatLogger

    from kvloom.interfaces import IterationStats, SchedulerStats

    config = SimpleNamespace(model=SimpleNamespace(served_model_name="m"))
    stat_logger = JsonLinesStatLogger(config)  # type: ignore[arg-type]
    stat_logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=3))
    stat_logger.log()
    assert (stat_logger.steps, stat_logger.generation_tokens) == (1, 3)
    assert list(tmp_path.iterdir()) == []
