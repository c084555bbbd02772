"""The example model plugin (plugins/examples/model), pip-installed: a tiny random HF Granite
checkpoint runs in kvloom with HF transformers' greedy tokens (in a batch, with chunked
prefill); without the plugin the architecture is not supported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import hf_greedy_tokens, random_prompts, save_tiny_checkpoint

SOURCE = Path(__file__).resolve().parents[1]
MAX_NEW = 8

GENERATE = """
import json, sys
from kvloom import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="32MiB", max_num_seqs=4, max_num_batched_tokens=32)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GraniteConfig

    # A tiny random Granite with a real tokenizer, saved as HF transformers saves it (offline).
    config = GraniteConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5,
        tie_word_embeddings=False,
    )  # fmt: skip
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("granite") / "tiny-granite")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(SOURCE, tmp_path_factory.mktemp("example-model"))


def _generate(model_dir: Path, prompts: list[list[int]], sites: list[Path]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", GENERATE, str(model_dir), json.dumps(prompts), str(MAX_NEW)]
    return subprocess.run(cmd, env=plugin_env(sites, KVLOOM_PLATFORM="cpu"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_greedy_tokens_match_hf(granite_dir: Path, site: Path) -> None:
    prompts = random_prompts(512)
    done = _generate(granite_dir, prompts, [site])
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens == hf_greedy_tokens(granite_dir, prompts, MAX_NEW)


def test_without_the_plugin_granite_is_not_supported(granite_dir: Path) -> None:
    done = _generate(granite_dir, [[5, 6, 7]], [])
    assert done.returncode != 0
    assert "model architecture ['GraniteForCausalLM']" in done.stderr and "is not supported" in done.stderr
