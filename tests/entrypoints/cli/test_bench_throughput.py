"""``kvloom bench throughput --compare-hf``: HF runs under the engine core's conditions (its
torch thread count and CPU affinity, in a process of its own), and both are stated."""

from __future__ import annotations

import pytest

from kvloom.entrypoints.cli.bench_throughput import describe_conditions, run_throughput, to_markdown
from tests.helpers.model_fixtures import tiny_model_dir


def test_hf_runs_under_the_engines_threads_and_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine core process sizes its threads itself (the CPU platform: idle cores, or
    # KVLOOM_CPU_THREADS); this process runs with another count, which HF must not inherit.
    monkeypatch.setenv("KVLOOM_CPU_THREADS", "1")
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the engine core in this process: quicker to start
    import torch

    monkeypatch.setattr(torch, "get_num_threads", torch.get_num_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = run_throughput({"model": str(tiny_model_dir("llama")), "dtype": "float32", "kv_cache_memory": "32MiB",
                                 "disable_log_stats": True}, num_prompts=2, input_len=8, output_len=4,
                                compare_hf=True)  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    engine, hf = result["kvloom"]["conditions"], result["hf"]["conditions"]
    assert engine["torch_threads"] == hf["torch_threads"] == 1
    assert engine["cpu_affinity"] == hf["cpu_affinity"] and engine["pid"] != hf["pid"]
    assert result["hf"]["output_tokens"] == 8 and result["speedup_output_tok_s"] > 0
    text = to_markdown(result, "kvloom bench throughput --compare-hf")
    assert f"Conditions, kvloom's engine core: {describe_conditions(engine)}" in text
    assert f"Conditions, HF transformers: {describe_conditions(hf)}" in text
    assert describe_conditions({"torch_threads": 3, "cpu_affinity": [0, 1, 2, 5], "pid": 7}) == (
        "3 torch threads on CPUs 0-2,5 (process 7)")  # fmt: skip
