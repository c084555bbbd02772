"""The out-of-tree platform example (plugins/cpu_threads_platform, distribution
kvloom-platform-cpu-threads), pip-installed here: with KVLOOM_CPU_THREADS_PLATFORM set,
kvloom picks it over the built-in CPU platform, and `kvloom generate` runs through its own
worker class (its log line, its thread count) with the same greedy tokens as HF; without
the variable the built-in CPU platform runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.model_fixtures import load_hf_model, tiny_model_dir
from tests.helpers.plugin_server import REPO, install_distribution, plugin_env

PLUGIN_SRC = REPO / "plugins" / "cpu_threads_platform"
CLI = [sys.executable, "-m", "kvloom"]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(PLUGIN_SRC, tmp_path_factory.mktemp("platform"))


def _run(site: Path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=plugin_env([site], **env), capture_output=True, text=True, timeout=300)


def test_backends_report_the_active_platform(site: Path) -> None:
    done = _run(site, ["backends", "--json"], KVLOOM_CPU_THREADS_PLATFORM="1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["platform"] == "cpu_threads"
    assert [c["name"] for c in report["candidates"]][:2] == ["CPU_ATTN", "FLEX_ATTENTION"]
    unset = _run(site, ["backends", "--json"])
    assert unset.returncode == 0, unset.stderr
    assert json.loads(unset.stdout)["platform"] == "cpu"  # not available: the built-in CPU platform runs


def test_generation_runs_through_the_platform_worker(site: Path) -> None:
    from transformers import AutoTokenizer

    model = tiny_model_dir("llama")
    args = ["generate", "--model", str(model), "--prompt", PROMPT, "--raw", "--json", "--max-tokens", "6",
            "--dtype", "float32"]  # fmt: skip
    done = _run(site, args, KVLOOM_CPU_THREADS_PLATFORM="1", KVLOOM_LOGGING_LEVEL="INFO")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "platform=cpu_threads" in done.stderr
    assert "cpu_threads worker: 1 torch threads" in done.stderr
    (result,) = json.loads(done.stdout)
    ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
    with torch.no_grad():
        expected = load_hf_model(model).generate(torch.tensor([ids]), max_new_tokens=6,
                                                 do_sample=False)[0, len(ids):].tolist()  # fmt: skip
    assert result["token_ids"] == expected


def test_bad_thread_count_is_an_error(site: Path) -> None:
    done = _run(site, ["backends", "--json"], KVLOOM_CPU_THREADS_PLATFORM="many")
    assert done.returncode != 0
    assert "KVLOOM_CPU_THREADS_PLATFORM must be a positive number of threads, got 'many'" in done.stderr
