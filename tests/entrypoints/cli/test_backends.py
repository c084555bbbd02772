"""`kvloom backends` in-process: flags, output formats, errors and `backends test`.

These run ``main()`` against the plugins installed in the test environment (at least the
CPU and CUDA platforms). Out-of-tree plugins through real installs are covered by
test_registry_install.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kvloom import plugins
from kvloom.entrypoints.cli import backends as backends_cli
from kvloom.entrypoints.cli.main import SUBCOMMAND_MODULES, build_parser, main

pytest.importorskip("kvloom_platform_cuda")


@pytest.fixture(autouse=True)
def default_plugins(fresh_plugins: None) -> None:
    """Every installed plugin, the default platform resolution."""


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    main(["backends", "--json", *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--device-capability", "10.0"], ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (["--device-capability", "sm90"], ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]),
        (["--device-capability", "80", "--use-mla", "--head-size", "576"],
         ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE"]),
    ],
)
def test_cuda_table_with_simulated_capability(capsys: pytest.CaptureFixture[str], args: list[str], expected: list[str]) -> None:
    report = run_json(capsys, "--platform", "cuda", *args)
    assert report["platform"] == "cuda"
    assert [(c["priority"], c["name"]) for c in report["candidates"][: len(expected)]] == list(enumerate(expected, 1))
    for c in report["candidates"]:
        assert set(c) == {"name", "priority", "valid", "reasons", "distribution", "version", "measured_ms"}
        assert c["valid"] == (c["reasons"] == [])
        assert c["name"] != report["selected"] or c["valid"]


def test_json_shape_on_the_active_platform(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["backends", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"platform", "device_name", "selected", "block_size", "candidates", "order", "tune_created"}
    assert report["platform"] == plugins.current_platform().name
    assert report["device_name"] == plugins.current_platform().get_device_name()
    assert code == (0 if report["selected"] else 1)
    if report["selected"] is not None:
        first_valid = next(c["name"] for c in report["candidates"] if c["valid"])
        assert report["selected"] == first_valid and report["block_size"] >= 1


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    main(["backends", "--platform", "cuda", "--device-capability", "8.0", "--dtype", "float16", "--kv-cache-dtype", "fp8"])
    out = capsys.readouterr().out
    # The device's name (get_device_name()) follows its type where the platform is available here.
    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cuda"
    assert f"Platform: cuda (kvloom-platform-cuda 0.1.0), device {device}, capability 8.0" in out
    assert "Configuration: head_size=128, dtype=float16, kv_cache_dtype=fp8, block_size=auto, use_mla=False" in out
    for header in ("#", "Backend", "Status", "Distribution", "Version", "Reasons"):
        assert header in out
    assert "kvloom-backend-flash-attn" in out and "Selected: " in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-capability", "abc"], "device capability 'abc': expected forms like 9.0, 90 or sm90"),
        (["--block-size", "0"], "--block-size: 0 is not a positive integer"),
        (["--head-size", "-4"], "--head-size: -4 is not a positive integer"),
        (["--platform", "tpu"], "Platform 'tpu': unknown platform. Loaded platforms: "),
        (["--model", "/no/such/model"], "model: '/no/such/model' is neither an HF model directory nor a .gguf file"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["backends", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvloom: error: ") and message in err
    assert "Traceback" not in err


def test_model_flag_reads_head_size_heads_and_dtype(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    parser = build_parser()
    cuda = plugins.get_platform_by_name("cuda")
    cpu = plugins.get_platform_by_name("cpu")
    args = parser.parse_args(["backends", "--model", str(tmp_path), "--device-capability", "9.0"])
    on_cuda = backends_cli.build_selector_config(args, cuda)
    assert (on_cuda.head_size, on_cuda.num_heads, on_cuda.num_kv_heads) == (64, 4, 2)
    assert on_cuda.dtype == torch.float16  # the checkpoint's half type on a half-precision platform
    assert str(on_cuda.device_capability) == "9.0" and on_cuda.device_type == "cuda"
    on_cpu = backends_cli.build_selector_config(parser.parse_args(["backends", "--model", str(tmp_path)]), cpu)
    assert on_cpu.dtype == torch.float32 and on_cpu.device_capability is None
    overridden = parser.parse_args(["backends", "--model", str(tmp_path), "--head-size", "32", "--dtype", "bfloat16"])
    config_cpu = backends_cli.build_selector_config(overridden, cpu)
    assert (config_cpu.head_size, config_cpu.dtype) == (32, torch.bfloat16)


def test_defaults_without_model() -> None:
    args = build_parser().parse_args(["backends"])
    config = backends_cli.build_selector_config(args, plugins.get_platform_by_name("cpu"))
    assert (config.head_size, config.dtype, config.kv_cache_dtype, config.block_size, config.use_mla) == (
        backends_cli.DEFAULT_HEAD_SIZE, torch.float32, "auto", None, False
    )


class FakeConformanceReport:
    def __init__(self, passed: bool) -> None:
        self.passed = passed

    def format(self) -> str:
        return f"conformance: {'PASS' if self.passed else 'FAIL'}"


@pytest.mark.parametrize("passed", [True, False])
def test_backends_test_runs_the_conformance_suite(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], passed: bool
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def run_conformance(name: str, **kwargs: Any) -> FakeConformanceReport:
        calls.append((name, kwargs))
        return FakeConformanceReport(passed)

    module = types.ModuleType("kvloom.testing.conformance")
    module.run_conformance = run_conformance  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvloom.testing.conformance", module)
    assert main(["backends", "test", "SOME_BACKEND"]) == (0 if passed else 1)
    assert main(["backends", "test", "SOME_BACKEND", "--device", "cuda", "--quick"]) == (0 if passed else 1)
    assert calls == [
        ("SOME_BACKEND", {"device": plugins.current_platform().device_type}),
        ("SOME_BACKEND", {"device": "cuda", "quick": True}),
    ]
    assert capsys.readouterr().out.count(f"conformance: {'PASS' if passed else 'FAIL'}") == 2


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert "kvloom.entrypoints.cli.backends" in SUBCOMMAND_MODULES
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "backends" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["backends", "--help"])
    out = capsys.readouterr().out
    assert "--device-capability" in out and "--json" in out and "test" in out


def test_subcommand_registration_contract() -> None:
    """Every subcommand module adds a parser with a callable ``func``."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    backends_cli.register_subparser(subparsers)
    assert callable(parser.parse_args(["backends"]).func)
    assert parser.parse_args(["backends", "test", "X"]).func is backends_cli.run_backend_test
