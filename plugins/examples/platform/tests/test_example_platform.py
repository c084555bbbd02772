"""The example platform (plugins/examples/platform), pip-installed with the example backend:
with KVLOOM_EXAMPLE_PLATFORM=1 it is the active platform, its priority list picks
EXAMPLE_ATTN, and `kvloom generate` runs through its worker and its custom op with HF
transformers' greedy tokens; without the variable the built-in CPU platform runs. The
custom op is bit-identical to the torch code it replaces (kvloom.testing.check_custom_op)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing import check_custom_op
from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import hf_greedy_tokens, tiny_model_dir

EXAMPLES = Path(__file__).resolve().parents[2]  # plugins/examples: this example and the backend example
CLI = [sys.executable, "-m", "kvloom"]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    work = tmp_path_factory.mktemp("example-platform")
    return [install_distribution(EXAMPLES / name, work) for name in ("platform", "attention_backend")]


def _run(sites: list[Path], args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=plugin_env(sites, **env), capture_output=True, text=True, timeout=300)


def test_available_only_when_asked(sites: list[Path]) -> None:
    done = _run(sites, ["backends", "--json"], KVLOOM_EXAMPLE_PLATFORM="1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["platform"] == "example_cpu"
    assert [c["name"] for c in report["candidates"]][:2] == ["EXAMPLE_ATTN", "CPU_ATTN"]
    assert report["selected"] == "EXAMPLE_ATTN"
    unset = _run(sites, ["backends", "--json"])
    assert unset.returncode == 0, unset.stderr
    assert json.loads(unset.stdout)["platform"] == "cpu"


def test_generate_runs_through_the_platform(sites: list[Path]) -> None:
    from transformers import AutoTokenizer

    model = tiny_model_dir("llama")
    args = ["generate", "--model", str(model), "--prompt", PROMPT, "--raw", "--json", "--max-tokens", "6",
            "--dtype", "float32"]  # fmt: skip
    done = _run(sites, args, KVLOOM_EXAMPLE_PLATFORM="1", KVLOOM_LOGGING_LEVEL="INFO")
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    assert "platform=example_cpu" in log and "backend=EXAMPLE_ATTN" in log, log[-3000:]
    assert "example_cpu worker on cpu" in log
    assert "Custom ops: silu_and_mul" in log
    (result,) = json.loads(done.stdout)
    ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
    assert result["token_ids"] == hf_greedy_tokens(model, [ids], 6)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the platform's supported_dtypes
def test_custom_op_matches_the_torch_code(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    import torch

    monkeypatch.syspath_prepend(str(EXAMPLES / "platform"))
    from kvloom_example_platform import silu_and_mul

    x = torch.randn(7, 2 * 128, dtype=getattr(torch, dtype))  # [tokens, 2 * intermediate_size]
    assert check_custom_op("silu_and_mul", silu_and_mul, x)["exact"] == 1.0  # bit-identical, as required
