"""The example model plugin (plugins/examples/model), pip-installed: a tiny random HF Granite
checkpoint runs in kvloom with HF transformers' greedy tokens (in a batch, with chunked
prefill); without the plugin the architecture is not supported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.model_fixtures import build_tokenizer, hf_greedy_tokens, random_prompts
from tests.helpers.plugin_server import install_distribution, plugin_env

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
    from transformers import AutoModelForCausalLM, GraniteConfig

    out = tmp_path_factory.mktemp("granite") / "tiny-granite"
    tokenizer = build_tokenizer()
    config = GraniteConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF starts norms at 1, which would hide mistakes in them
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


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
