"""benchmarks/peers/report.py renders the peers' JSON files (fake ones here, from two leases) into the tables of
docs/benchmarks/peers_h200.md, dividing only numbers of one lease; vLLM's client results in kvloom's keys; SGLang behind
vLLM's offline interface; bench_decode.py's step arithmetic; bench_serving.py's runs and server commands."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
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
H200 = "NVIDIA H200"
VERSIONS = {"vllm": "0.26.0", "sglang": "0.5.15.post1", "kvloom": "0.1.0"}


def _header(engine: str, workload: str, lease: str = "gpu-a-1111") -> dict:
    return {"engine": engine, "version": VERSIONS[engine], "workload": workload, "lease": lease,
            "date": "2026-11-29 10:00 UTC", "gpu": H200, "torch": "2.11.0+cu130", "python": "3.12.3",
            "command": f"python3 benchmarks/peers/bench_{workload}.py --engine {engine}"}  # fmt: skip


def _offline(engine: str, tok_s: list[float], lease: str = "gpu-a-1111") -> dict:
    spec = {"num_seqs": 256, "prompt_tokens": 143_000, "output_tokens": 133_966, "temperature": 0.6,
            "ignore_eos": True, "model": "Qwen3-0.6B shape, dummy bf16 weights"}  # fmt: skip
    runs = [{"wall_s": 133_966 / t, "output_tokens": 133_966, "output_tok_s": t} for t in tok_s]
    return {**_header(engine, "offline", lease), "spec": spec, "settings": {"dtype": "bfloat16"}, "init_s": 12.0,
            "runs": runs}  # fmt: skip


def _decode(engine: str, steps: dict[int, float], lease: str = "gpu-a-1111") -> dict:
    spec = {"model": "Llama-3-8B shape, dummy bf16 weights", "context": 1024, "short": 16, "long": 80, "repeats": 3,
            "mean_context": 1072}  # fmt: skip
    rows = [{"batch": b, "step_s": s, "tok_s": b / s, "short_s": [1.0], "long_s": [1.0]} for b, s in steps.items()]
    return {**_header(engine, "decode", lease), "method": "generate-difference", "spec": spec, "settings": {},
            "init_s": 30.0, "rows": rows}  # fmt: skip


def _served(client: str, tok_s: float, hit: float | None = 0.0) -> dict:
    stats = {"mean": 1.0, "median": 2.0, "p90": 3.0, "p99": 4.0}
    return {"client": client, "client_command": f"{client} bench serve --num-prompts 1000", "completed": 1000,
            "failed": 0, "output_throughput": tok_s, "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats,
            "prefix_cache": {"hit_rate": hit}}  # fmt: skip


def _serving(engine: str, runs: dict, lease: str = "gpu-a-1111", startup: float = 200.0) -> dict:
    spec = {"model": "Qwen3-0.6B shape, dummy bf16 weights", "input_len": 512, "output_len": 256,
            "tokenizer": ".benchtok", "repeats": 1}  # fmt: skip
    return {**_header(engine, "serving", lease), "spec": spec, "runs": runs, "startup_s": startup,
            "startup_warm_s": startup / 2, "server_command": f"python3 -m {engine} serve M", "settings": []}  # fmt: skip


def _write(d: Path, name: str, data: dict) -> None:
    (d / f"{name}.json").write_text(json.dumps(data))


@pytest.fixture
def two_leases(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Lease A: vLLM then kvloom; lease B (another machine): SGLang then kvloom."""
    a, b = tmp_path_factory.mktemp("lease_a"), tmp_path_factory.mktemp("lease_b")
    _write(a, "vllm_offline", _offline("vllm", [18_000.0, 20_000.0]))
    _write(a, "kvloom_offline", _offline("kvloom", [22_000.0, 24_000.0]))
    _write(a, "vllm_decode", _decode("vllm", {16: 0.008, 64: 0.010}))
    _write(a, "kvloom_decode", _decode("kvloom", {16: 0.0064, 64: 0.0125}))
    _write(a, "kvloom_decode_steps", {"command": "python3 benchmarks/bench_decode_roofline.py",
                                      "rows": [{"batch": 16, "mean_s": 0.0063}]})  # fmt: skip
    _write(a, "vllm_serving", _serving("vllm", {"64": {"num_prompts": 1000, "vllm": [_served("vllm", 15_000.0)],
                                                       "kvloom": [_served("kvloom", 14_000.0)]}}, startup=200.0))  # fmt: skip
    _write(a, "kvloom_serving", _serving("kvloom", {"64": {
        "num_prompts": 1000, "vllm": [_served("vllm", 16_000.0), _served("vllm", 18_000.0), _served("vllm", 17_000.0)],
        "kvloom": [_served("kvloom", 16_800.0, 0.25)]}}, startup=80.0))  # fmt: skip
    _write(b, "sglang_offline", _offline("sglang", [30_000.0], lease="gpu-b-2222"))
    _write(b, "kvloom_offline", _offline("kvloom", [27_000.0], lease="gpu-b-2222"))
    return [a, b]


def _rows(text: str, start: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith(start)]


def test_ratios_divide_only_numbers_of_one_lease(two_leases: list[Path]) -> None:
    leases = report.load(two_leases)
    assert set(leases) == {"gpu-a-1111", "gpu-b-2222"}
    text = report.render(leases)
    # offline: vLLM beside lease A's kvloom (24,000 / 20,000), SGLang beside lease B's (27,000 / 30,000)
    (vllm,) = _rows(text, "| L1 | vllm | 0.26.0 |")
    assert vllm[3:] == ["12", "18,000, 20,000", "20,000", "**1.20x**"]
    (sglang,) = _rows(text, "| L2 | sglang | 0.5.15.post1 |")
    assert sglang[-1] == "**0.90x**"
    kvloom = _rows(text, "| L1 | kvloom | 0.1.0 |") + _rows(text, "| L2 | kvloom | 0.1.0 |")
    assert [r[-1] for r in kvloom] == ["–", "–"]
    # decode: the peer's step / kvloom's step; kvloom's engine-step cross-check on its row
    assert _rows(text, "| L1 | 16 | vllm |")[0][3:5] == ["8.00", "**1.25x**"]
    assert _rows(text, "| L1 | 16 | kvloom |")[0][3:] == ["6.40", "–", "6.30"]
    assert _rows(text, "| L1 | 64 | vllm |")[0][4] == "**0.80x**"
    # serving: the median of the repeats, per client; each client's ratio against the same client's peer run
    (kv_vclient,) = _rows(text, "| L1 | 64 | 1000 | kvloom | vllm |")
    assert kv_vclient[5:7] == ["3 (0)", "17,000"]
    assert _rows(text, "| L1 | 64 | 1000 | vllm | vllm |")[0][-1] == "**1.13x**"  # 17,000 / 15,000
    assert _rows(text, "| L1 | 64 | 1000 | vllm | kvloom |")[0][-1] == "**1.20x**"  # 16,800 / 14,000
    assert _rows(text, "| L1 | 64 | 1000 | kvloom | kvloom |")[0][-2] == "25.0%"
    # start-up: kvloom's time over the peer's, cold and warm
    assert _rows(text, "| L1 | vllm | 200 |")[0][-1] == "0.40x, 0.40x"
    for needle in ("NVIDIA H200, torch 2.11.0+cu130", "vllm 0.26.0", "sglang 0.5.15.post1", "lease `gpu-a-1111`",
                   "lease `gpu-b-2222`", "python3 -m vllm serve M", "bench_decode_roofline.py"):  # fmt: skip
        assert needle in text, needle


def test_missing_and_failed_runs_are_reported_not_hidden(two_leases: list[Path]) -> None:
    a = two_leases[0]
    broken = _serving("kvloom", {"64": {"num_prompts": 1000, "vllm": [{"client": "vllm", "error": "client timed out"}],
                                        "kvloom": [_served("kvloom", 16_800.0, None)]}})  # fmt: skip
    _write(a, "kvloom_serving", broken)
    (a / "vllm_decode.json").unlink()
    text = report.render(report.load(two_leases))
    failed = _rows(text, "| L1 | 64 | 1000 | kvloom | vllm |")[0]
    assert failed[5].startswith("1 (1: 'client timed out'") and failed[6] == "–" and failed[-1] == "–"
    assert _rows(text, "| L1 | 64 | 1000 | kvloom | kvloom |")[0][-2] == "n/a"
    assert not _rows(text, "| L1 | 16 | vllm |")
    only_offline = report.render(report.load([two_leases[1]]))
    assert "## Serving: each engine's OpenAI server, vLLM's client and kvloom's\n\nNot measured." in only_offline


def test_a_result_without_a_lease_is_a_lease_of_its_directory(tmp_path: Path) -> None:
    old = _offline("kvloom", [15_000.0])
    del old["lease"]
    _write(tmp_path, "kvloom_offline", old)
    _write(tmp_path, "kvloom_decode", _decode("kvloom", {1: 0.01}))
    _write(tmp_path, "kvloom_decode_steps", {"command": "x", "rows": [{"batch": 1, "mean_s": 0.0099}]})
    leases = report.load([tmp_path])
    assert set(leases) == {f"{tmp_path.name} (no lease recorded)", "gpu-a-1111"}
    assert "kvloom_decode_steps" in leases["gpu-a-1111"]  # beside the kvloom decode of its directory


def test_no_results_and_missing_directory_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no peer results"):
        report.render(report.load([tmp_path]))
    with pytest.raises(SystemExit, match="does not exist"):
        report.load([tmp_path / "nope"])


def test_main_writes_the_markdown(two_leases: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "peers.md"
    assert report.main([str(d) for d in two_leases] + ["--out", str(out)]) == 0
    assert out.read_text().startswith("# kvloom and its peers side by side on the H200")
    assert "## Notes on" not in out.read_text()
    (two_leases[1] / "notes.md").write_text("The TTFT gap is the front end.\n")
    assert report.main([str(d) for d in two_leases] + ["--out", str(out)]) == 0
    text = out.read_text()
    assert f"## Notes on `{two_leases[1].name}`\n\nThe TTFT gap is the front end.\n" in text
    assert text.index("## Notes on") < text.index("## Leases and commands")


def test_vllm_clients_results_in_kvloom_bench_serve_keys() -> None:
    clients = _module("serve_clients")
    data = {"completed": 998, "duration": 20.0, "request_throughput": 49.9, "output_throughput": 12_000.0,
            "total_token_throughput": 36_000.0, "max_output_tokens_per_s": 15_000.0, "mean_ttft_ms": 100.0,
            "median_ttft_ms": 90.0, "p99_ttft_ms": 300.0, "median_tpot_ms": 3.5, "median_itl_ms": 3.4,
            "p99_itl_ms": 18.0, "mean_e2el_ms": 900.0}  # fmt: skip
    run = clients.from_vllm(data, 1000)
    assert (run["completed"], run["failed"], run["peak_output_throughput"]) == (998, 2, 15_000.0)
    assert run["ttft_ms"] == {"mean": 100.0, "median": 90.0, "p90": None, "p99": 300.0}
    assert run["itl_ms"]["p99"] == 18.0 and run["e2e_latency_ms"]["mean"] == 900.0


def test_sglang_behind_vllms_offline_interface() -> None:
    engines = _module("engines")
    calls = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            calls.append((input_ids, sampling_params))
            return [{"output_ids": [7] * p["max_new_tokens"]} for p in sampling_params]

        def flush_cache(self):
            calls.append("flush")

    llm = engines.SGLangLLM(FakeEngine())
    params = engines.SGLangSamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[7, 7, 7], [7, 7, 7]]
    assert calls[0] == ([[1, 2], [3]], [{"max_new_tokens": 3, "temperature": 0.6, "ignore_eos": True}] * 2)
    llm.reset_prefix_cache()
    assert calls[-1] == "flush"


def test_decode_step_by_difference() -> None:
    sys.path.insert(0, str(PEERS.parent))  # bench_decode imports bench_decode_roofline from benchmarks/
    decode = _module("bench_decode")
    assert decode.step_by_difference([1.0, 1.2, 0.9], [2.0, 3.0, 1.64], 16, 80) == pytest.approx(1.0 / 64)
    with pytest.raises(ValueError, match="n_long > n_short"):
        decode.step_by_difference([1.0], [2.0], 8, 8)
    with pytest.raises(ValueError, match="at least one timing"):
        decode.step_by_difference([], [2.0], 8, 16)


def test_serving_runs_parse() -> None:
    sys.path.insert(0, str(PEERS))
    sys.path.insert(0, str(PEERS.parent))
    serving = _module("bench_serving")
    assert serving.parse_runs("inf:1000,64:1000,1:64") == [(None, 1000), (64, 1000), (1, 64)]
    with pytest.raises(ValueError, match="CAP:PROMPTS"):
        serving.parse_runs("64")
    cmd = serving.server_command("sglang", Path("/m"), 5, ["--enable-metrics"], 2048)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--context-length" in cmd and "--enable-metrics" in cmd
    assert "--attention-backend" not in serving.server_command("kvloom", Path("/m"), 5, [], 2048)


quant_report = _module("quant_report")


def _quant(quantization: str, steps: dict[int, float], lease: str = "gpu-a-1111", engine: str = "kvloom",
           kv: str = "auto", linear_bytes: float = 2.0) -> dict:  # fmt: skip
    spec = {"model": "Llama-3-8B shape, dummy weights", "context": 1024, "short": 16, "long": 80, "repeats": 3,
            "mean_context": 1072, "quantization": quantization, "kv_cache_dtype": kv}  # fmt: skip
    decode = _module("bench_decode")
    rows = [{"batch": b, "step_s": s, "tok_s": b / s,
             **decode.bytes_per_step(b, 1072, linear_bytes, decode.KV_DTYPES[kv])} for b, s in steps.items()]  # fmt: skip
    return {**_header(engine, "decode", lease), "method": "generate-difference", "spec": spec, "rows": rows}


def test_quant_report_divides_by_the_bf16_step_of_the_same_engine_and_lease(tmp_path: Path) -> None:
    decode = _module("bench_decode")
    fp8_bytes = decode.CHECKPOINTS["fp8"][1]
    results = {
        "kvloom_none": _quant("none", {1: 0.004, 64: 0.008}),
        "kvloom_fp8": _quant("fp8", {1: 0.0025, 64: 0.0064}, linear_bytes=fp8_bytes),
        "vllm_fp8": _quant("fp8", {1: 0.003}, engine="vllm", linear_bytes=fp8_bytes),
        "kvloom_awq_other_lease": _quant("awq", {1: 0.001}, lease="gpu-b-2222", linear_bytes=0.52),
    }
    for name, data in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    lines = quant_report.table(quant_report.load(tmp_path))
    # The AWQ row has no bf16 row in its lease, vLLM none at all: neither is divided.
    assert [(x["engine"], x["batch"], x["quantization"]) for x in lines] == [("kvloom", 1, "fp8"), ("kvloom", 64, "fp8")]
    one, sixty_four = lines
    assert one["speedup"] == pytest.approx(1.6) and one["vs_vllm"] == pytest.approx(1.2)
    assert sixty_four["speedup"] == pytest.approx(1.25) and sixty_four["vs_vllm"] is None
    # Byte ceilings of the Llama-3-8B shape: the LM head stays bf16, the KV cache grows with the batch.
    assert one["ceiling"] == pytest.approx(1.85, abs=0.01) and sixty_four["ceiling"] == pytest.approx(1.41, abs=0.01)
    assert "not measured" in quant_report.markdown(lines)


def test_bench_decode_writes_each_checkpoint_config() -> None:
    from transformers import AutoConfig

    decode = _module("bench_decode")
    for name, (config, _) in decode.CHECKPOINTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = decode.write_llama3_config(Path(tmp) / "m", config)
            saved = getattr(AutoConfig.from_pretrained(path), "quantization_config", None)
            assert (saved or None) == config, name
