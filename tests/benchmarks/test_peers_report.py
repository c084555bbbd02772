"""benchmarks/peers/report.py renders the peers' JSON files (fake ones here) into the tables of
docs/benchmarks/peers_h100.md; benchmarks/peers/bench_decode.py's step arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _module("report")


def _header(engine: str, workload: str, gpu: str = "NVIDIA H100 80GB HBM3") -> dict:
    return {"engine": engine, "version": {"vllm": "0.24.0", "kvloom": "0.1.0"}[engine], "workload": workload,
            "date": "2026-11-25 21:00 UTC", "gpu": gpu, "torch": "2.11.0+cu130", "python": "3.12.3",
            "command": f"python3 benchmarks/peers/bench_{workload}.py --engine {engine}"}  # fmt: skip


def _offline(engine: str, tok_s: list[float]) -> dict:
    spec = {"num_seqs": 256, "prompt_tokens": 143_000, "output_tokens": 133_966, "temperature": 0.6,
            "ignore_eos": True, "model": "Qwen3-0.6B shape, dummy bf16 weights"}  # fmt: skip
    runs = [{"wall_s": 133_966 / t, "output_tokens": 133_966, "output_tok_s": t} for t in tok_s]
    return {**_header(engine, "offline"), "spec": spec, "settings": {"dtype": "bfloat16"}, "init_s": 12.0, "runs": runs}


def _decode(engine: str, steps: dict[int, float]) -> dict:
    spec = {"model": "Llama-3-8B shape, dummy bf16 weights", "context": 1024, "short": 16, "long": 80, "repeats": 3,
            "mean_context": 1072}  # fmt: skip
    rows = [
        {"batch": b, "step_s": s, "tok_s": b / s, "short_s": [1.0], "long_s": [1.0 + 64 * s]} for b, s in steps.items()
    ]
    return {**_header(engine, "decode"), "method": "generate-difference", "spec": spec, "settings": {}, "init_s": 30.0,
            "rows": rows}  # fmt: skip


def _served(tok_s: float) -> dict:
    stats = {"mean": 1.0, "p50": 2.0, "p90": 3.0, "p99": 4.0}
    return {"client_command": "python3 -m kvloom.entrypoints.cli.main bench serve --num-prompts 1000",
            "completed": 1000, "failed": 0, "output_throughput": tok_s, "ttft_ms": stats, "tpot_ms": stats,
            "itl_ms": stats}  # fmt: skip


def _serving(engine: str, runs: dict) -> dict:
    spec = {"model": "Qwen3-0.6B shape, dummy bf16 weights", "num_prompts": 1000, "input_len": 512, "output_len": 256,
            "tokenizer": ".benchtok"}  # fmt: skip
    return {**_header(engine, "serving"), "spec": spec, "runs": runs, "server_command": f"python3 -m {engine} serve M",
            "settings": ["--dtype", "bfloat16"], "startup_s": 240.0}  # fmt: skip


def _write(d: Path, name: str, data: dict) -> None:
    (d / f"{name}.json").write_text(json.dumps(data))


@pytest.fixture
def full(tmp_path: Path) -> Path:
    _write(tmp_path, "vllm_offline", _offline("vllm", [18_000.0, 20_000.0]))
    _write(tmp_path, "kvloom_offline", _offline("kvloom", [15_000.0, 16_000.0]))
    _write(tmp_path, "vllm_decode", _decode("vllm", {1: 0.008, 64: 0.010}))
    _write(tmp_path, "kvloom_decode", _decode("kvloom", {1: 0.010, 64: 0.0125}))
    _write(tmp_path, "kvloom_decode_steps", {"command": "python3 benchmarks/bench_decode_roofline.py",
                                              "rows": [{"batch": 1, "mean_s": 0.0099}, {"batch": 64, "mean_s": 0.0121}]})  # fmt: skip
    _write(tmp_path, "vllm_serving", _serving("vllm", {"inf": _served(8_000.0), "64": _served(11_000.0)}))
    _write(tmp_path, "kvloom_serving", _serving("kvloom", {"inf": _served(6_000.0), "64": _served(5_500.0)}))
    return tmp_path


def _table_row(text: str, start: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, rows)
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_full_report_has_each_workload_with_ratios(full: Path) -> None:
    text = report.render(report.load([full]))
    # offline: best runs 16,000 / 20,000
    assert _table_row(text, "| kvloom | 0.1.0 |") == ["kvloom", "0.1.0", "12", "15,000, 16,000", "16,000", "**0.80x**"]
    assert _table_row(text, "| vllm | 0.24.0 |")[3:5] == ["18,000, 20,000", "20,000"]
    # decode: throughput ratio = vLLM step / kvloom step; the engine-step cross-check beside it
    assert _table_row(text, "| 1 | 8") == ["1", "8.00", "10.00", "**0.80x**", "9.90"]
    assert _table_row(text, "| 64 | 10") == ["64", "10.00", "12.50", "**0.80x**", "12.10"]
    # serving: all at once first, then concurrency 64
    assert _table_row(text, "| inf | kvloom |")[-1] == "**0.75x**"
    assert _table_row(text, "| 64 | kvloom |")[-1] == "**0.50x**"
    assert text.index("| inf | vllm |") < text.index("| 64 | vllm |")
    for needle in (
        "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130",
        "vllm 0.24.0",
        "kvloom 0.1.0",
        "nano-vllm is not run",
        "python3 -m vllm serve M",
        "bench serve --num-prompts 1000",
        "bench_decode_roofline.py",
    ):
        assert needle in text, needle
    assert "Warning" not in text


def test_missing_and_failed_runs_are_reported_not_hidden(full: Path) -> None:
    (full / "vllm_decode.json").unlink()
    (full / "kvloom_decode_steps.json").unlink()
    broken = _serving("kvloom", {"inf": _served(6_000.0), "64": {"error": "client timed out"}})
    _write(full, "kvloom_serving", broken)
    text = report.render(report.load([full]))
    assert _table_row(text, "| 1 | –") == ["1", "–", "10.00", "–", "–"]
    assert "failed: 'client timed out'" in _table_row(text, "| 64 | kvloom |")[3]
    (full / "vllm_offline.json").unlink()
    text = report.render(report.load([full]))
    assert _table_row(text, "| vllm | – |")[3] == "not measured"
    assert _table_row(text, "| kvloom | 0.1.0 |")[-1] == "–"


def test_a_kvloom_serving_variant_gets_its_own_rows_and_ratio(full: Path) -> None:
    variant = _serving("kvloom", {"inf": _served(9_000.0), "64": _served(12_100.0)})
    variant["server_command"] = "python3 -m kvloom serve M --torch-compile"
    _write(full, "kvloom-compile_serving", variant)
    text = report.render(report.load([full]))
    assert _table_row(text, "| 64 | kvloom-compile |")[-1] == "**1.10x**"
    assert _table_row(text, "| 64 | kvloom |")[-1] == "**0.50x**"
    assert text.index("| 64 | kvloom |") < text.index("| 64 | kvloom-compile |")
    assert "kvloom-compile (kvloom 0.1.0) server: `python3 -m kvloom serve M --torch-compile`" in text


def test_results_from_two_machines_are_flagged(full: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("other")
    data = _offline("kvloom", [15_000.0])
    data["gpu"] = "NVIDIA H200"
    _write(other, "kvloom_offline", data)
    text = report.render(report.load([full, other]))  # the later directory wins on a clash
    assert "results come from 2 different machines" in text
    assert _table_row(text, "| kvloom | 0.1.0 |")[3] == "15,000"


def test_no_results_and_missing_directory_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no peer results"):
        report.render(report.load([tmp_path]))
    with pytest.raises(SystemExit, match="does not exist"):
        report.load([tmp_path / "nope"])


def test_main_writes_the_markdown(full: Path, tmp_path: Path) -> None:
    out = tmp_path / "peers.md"
    assert report.main([str(full), "--out", str(out)]) == 0
    assert out.read_text().startswith("# kvloom and its peers side by side on the H100")


def test_decode_step_by_difference() -> None:
    sys.path.insert(0, str(PEERS.parent))  # bench_decode imports bench_decode_roofline from benchmarks/
    decode = _module("bench_decode")
    assert decode.step_by_difference([1.0, 1.2, 0.9], [2.0, 3.0, 1.64], 16, 80) == pytest.approx(1.0 / 64)
    with pytest.raises(ValueError, match="n_long > n_short"):
        decode.step_by_difference([1.0], [2.0], 8, 8)
    with pytest.raises(ValueError, match="at least one timing"):
        decode.step_by_difference([], [2.0], 8, 16)
