"""The example attention backend (plugins/examples/attention_backend): the conformance suite
in-process, then pip-installed: `kvloom backends test EXAMPLE_ATTN` and a tiny Llama end to
end through `LLM(..., attention_backend="EXAMPLE_ATTN")` with HF transformers' greedy tokens
(chunked prefill and prefix-cache hits included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing import run_conformance
from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import hf_greedy_tokens, random_prompts, tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "kvloom"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(SOURCE, tmp_path_factory.mktemp("example-backend"))


def test_conformance_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SOURCE))
    from kvloom_example_attention_backend import ExampleAttentionBackend

    report = run_conformance(ExampleAttentionBackend, device="cpu", seed=0)
    assert report.passed, report.format()
    assert len(report.cases) > 30  # every declared dtype, head size and block size


def test_backends_test_command(site: Path) -> None:
    done = subprocess.run([*CLI, "backends", "test", "EXAMPLE_ATTN", "--quick"],
                          env=plugin_env([site], KVLOOM_CONFORMANCE_SEED="1"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout


GENERATE = """
import json, sys
from kvloom import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], attention_backend="EXAMPLE_ATTN", dtype="float32", kv_cache_memory="32MiB",
          max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=True)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
again = llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)  # prefix-cache hits
print(json.dumps({"backend": llm.config.attention.backend.NAME,
                  "tokens": [o.outputs[0].token_ids for o in outputs + again]}))
"""


def test_tiny_model_matches_hf(site: Path) -> None:
    model = tiny_model_dir("llama")
    prompts = random_prompts(512)
    done = subprocess.run([sys.executable, "-c", GENERATE, str(model), json.dumps(prompts)],
                          env=plugin_env([site], KVLOOM_PLATFORM="cpu"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "EXAMPLE_ATTN"
    expected = hf_greedy_tokens(model, prompts, 8)
    assert result["tokens"] == expected + expected[-1:]


def test_validation_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvloom.interfaces import AttentionSelectorConfig

    monkeypatch.syspath_prepend(str(SOURCE))
    from kvloom_example_attention_backend import ExampleAttentionBackend

    ok = AttentionSelectorConfig(head_size=64, dtype=torch.float32, num_heads=8, num_kv_heads=2)
    assert ExampleAttentionBackend.validate_configuration(ok) == []
    bad = AttentionSelectorConfig(head_size=96, dtype=torch.float32, block_size=12, num_heads=6, num_kv_heads=4)
    assert ExampleAttentionBackend.validate_configuration(bad) == [
        "block size 12 not supported (supports multiples of 8)",
        "head size 96 not supported (supports 16, 32, 64, 128)",
        "num_heads 6 is not a multiple of num_kv_heads 4",
    ]
