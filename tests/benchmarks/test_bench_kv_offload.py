"""``benchmarks/bench_kv_offload.py`` end to end on the CPU (so it cannot rot before its H200
run): two ``kvloom serve`` of the tiny Llama with a 512-token device pool, 16 conversations
whose prefixes are 4x that pool, two turns each, round robin. Without a host tier the
second turns find nothing cached (the round robin evicted every prefix); with one they load
their prefixes back from it (counted at ``/metrics``), and the report says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing.models import tiny_model_dir

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_offload.py"
CONVERSATIONS, TURNS, BLOCK = 16, 2, 16
BLOCK_BYTES = 8192  # the tiny Llama's block: 2 layers x K and V x 16 tokens x 4 heads x 8 x fp32


@pytest.mark.slow
def test_offloading_brings_evicted_prefixes_back(tmp_path: Path) -> None:
    result_path, markdown = tmp_path / "result.json", tmp_path / "result.md"
    engine_args = f"--block-size {BLOCK} --max-model-len 256 --dtype float32"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir("llama")), "--kv-cache-memory", "256KiB",
           "--kv-offloading-size", str(8 / 1024), "--engine-args", engine_args, "--prefix-ratio", "4", "--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--user-len", "8",
           "--output-len", "4", "--max-concurrency", "2", "--out", str(tmp_path), "--json", str(result_path),
           "--markdown", str(markdown)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["pool_tokens"] == 512 and result["pool_source"] == "kvloom:cache_config_info"
    assert result["prefix_len"] == 4 * 512 // CONVERSATIONS
    base, off = result["runs"]["no offload"], result["runs"]["offload"]
    for run in (base, off):
        assert (run["completed"], run["failed"]) == (CONVERSATIONS * TURNS, 0)
        assert run["ttft_ms_first_turns"]["median"] > 0 and run["ttft_ms_later_turns"]["median"] > 0
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    # Without a host tier: no connector, and the device kept no prefix until its next turn.
    assert base["connector"] == {"hits_by_tier": {}, "transfers": {}}
    assert base["prefix_cache"]["hits"] == 0
    # With one: every second turn loads at least its prefix's full blocks back from the host.
    hits = off["connector"]["hits_by_tier"].get("cpu", 0)
    assert hits >= CONVERSATIONS * (result["prefix_len"] // BLOCK) * BLOCK
    loaded, stored = off["connector"]["transfers"]["host_to_device"], off["connector"]["transfers"]["device_to_host"]
    assert loaded["blocks"] * BLOCK == hits and loaded["bytes_per_block"] == BLOCK_BYTES
    assert stored["blocks"] >= loaded["blocks"] and stored["bytes"] == stored["blocks"] * BLOCK_BYTES
    comparison = result["comparison"]
    assert comparison["ttft_p50_later_turns_speedup"] > 0 and comparison["target"] == 2.0
    assert set(comparison["bandwidth"]) == {"host_to_device", "device_to_host"}
    assert comparison["bandwidth"]["host_to_device"]["fraction_of_pcie"] > 0
    report = markdown.read_text()
    assert "Later turns' TTFT p50, without / with offloading" in report and "| host_to_device |" in report
    assert (tmp_path / "serve_offload.log").is_file()
