"""``benchmarks/bench_structured_output.py`` runs (so it cannot rot before its GPU run):
its main with a tiny Qwen3 on the CPU, a few requests of a few steps, both scheduling
modes, and the JSON it writes says what the benchmark measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvloom.testing.models import build_tokenizer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "bench_structured_output", raising=False)
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # main sets it; restored after the test
    monkeypatch.setenv("KVLOOM_PLATFORM", "cpu")
    import bench_structured_output

    return bench_structured_output


def test_main_on_a_tiny_cpu_model(bench, tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_dir)
    # 24 tokens cut every constrained request short of its schema: outputs are counted as
    # truncated, not validated; every step decodes the whole batch.
    result = bench.main(["--tokenizer", str(tok_dir), "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                         "--batch", "3", "--prompt-len", "8", "--max-tokens", "24", "--out", str(tmp_path / "out")])  # fmt: skip
    written = json.loads((tmp_path / "out" / "structured_output.json").read_text())
    assert written["worst_step_time_ratio"] == result["worst_step_time_ratio"] > 0
    assert [r["mode"] for r in written["runs"]] == ["sync", "async"]
    for run in written["runs"]:
        assert run["constrained"]["output_tokens"] == [24] * 3 and run["truncated_outputs"] == 3
        assert run["plain"]["output_tokens"] == [24] * 3
        for kind in ("constrained", "plain"):
            assert run[kind]["full_batch_steps"] >= 20 and run[kind]["step_ms_median"] > 0
        assert run["constrained"]["fill_ms_median"] > 0 and run["constrained"]["apply_host_ms_median"] > 0
        assert run["plain"]["fill_ms_median"] is None  # no structured request, no bitmask
        assert 0 < run["compile"]["cached_s"] < run["compile"]["cold_s"]
    assert written["constrained_tokens_identical_sync_async"] is True
    # The overlap async scheduling gives a plain decode, a structured one keeps it too.
    assert written["async_plain_overlaps"] is True
    assert written["async_constrained_overlaps"] is True
    assert written["structured_requests_force_synchronous_steps"] is False


def test_bad_modes_are_refused(bench, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--tokenizer", str(tmp_path), "--modes", "sync,later", "--device", "cpu"])
