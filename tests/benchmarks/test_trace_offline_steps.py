"""benchmarks/trace_offline_steps.py: its step trace records every engine step of a real
(tiny, CPU) engine, with the scheduled tokens adding up, and its summary groups them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvloom.testing.models import tiny_model_dir

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROMPTS = [[3, 17, 250, 9, 41], [5, 6, 7, 100, 200, 300, 11, 12, 13], [400, 2, 77]]
MAX_TOKENS = 5


@pytest.fixture
def trace_module(monkeypatch: pytest.MonkeyPatch):
    # The script runs the engine core in its own process (it sets the variable on import):
    # restored after the test.
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("trace_offline_steps", BENCHMARKS / "trace_offline_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("trace_offline_steps", None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_trace_records_every_step(trace_module, async_scheduling: bool) -> None:
    from kvloom import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", async_scheduling=async_scheduling,
              max_num_batched_tokens=8, max_num_seqs=4, disable_log_stats=True)  # fmt: skip
    try:
        trace = trace_module.StepTrace(llm.llm_engine.engine_core.core)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    records = trace.records
    # Every prompt token is computed once and every output token but the last is fed back.
    assert sum(r["tokens"] for r in records) == sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert all(r["tokens"] <= 8 for r in records)  # the step budget
    assert any(r["decodes"] < r["reqs"] for r in records) and any(r["decodes"] == r["reqs"] for r in records)
    assert all({"schedule_s", "launch_s", "update_s"} <= set(r) for r in records)
    if async_scheduling:  # the wait for each step's tokens is timed
        assert all("wait_s" in r for r in records)
    wall = records[-1]["t_done"] - records[0]["t_start"]
    table = trace_module.summarize(records, wall)
    assert sum(g["steps"] for g in table.values()) == len(records)
    assert {name.split()[0] for name in table} == {"decode", "mixed"}
    assert sum(g["share_of_wall"] for g in table.values()) == pytest.approx(1.0)
