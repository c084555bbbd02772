"""The out-of-tree model example (plugins/gemma, distribution kvloom-gemma): its Gemma class
built from kvloom layers matches HF transformers' logits, and `kvloom serve` of a Gemma
checkpoint works once the distribution is pip-installed (and fails without it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvloom.testing import load_model
from tests.helpers.model_fixtures import (
    PagedRunner,
    assert_logits_close,
    build_tokenizer,
    hf_logits,
    load_hf_model,
    make_test_engine_config,  # fmt: skip
)
from tests.helpers.plugin_server import REPO, KvloomServer, install_distribution, plugin_env

PLUGIN_SRC = REPO / "plugins" / "gemma"
PROMPTS = [[5, 17, 33, 48, 90, 11], [7, 8, 9, 10, 300, 301, 302]]
MAX_NEW = 8


def _save_tiny_gemma(out: Path, **overrides: object) -> Path:
    from transformers import AutoModelForCausalLM, GemmaConfig

    tokenizer = build_tokenizer()
    config = GemmaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.1,
        rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF starts Gemma norms at 0 (scale 1), which would hide mistakes
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_gemma(tmp_path_factory.mktemp("gemma") / "tiny-gemma")


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "untied_head"])
def test_gemma_class_matches_hf_logits(
    gemma_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    """Also a checkpoint whose LM head is not tied to the embeddings (its own lm_head.weight)."""
    if not tied:
        gemma_dir = _save_tiny_gemma(tmp_path / "untied", tie_word_embeddings=False)
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from kvloom_gemma.model import GemmaForCausalLM

    config = make_test_engine_config(gemma_dir)  # float32
    model = load_model(GemmaForCausalLM, config)
    runner = PagedRunner(model.eval(), config)
    hf = load_hf_model(gemma_dir)
    for i, ids in enumerate(PROMPTS):
        prefill = runner.step({i: ids[:-1]})[i]
        decode = runner.step({i: ids[-1:]})[i]
        assert_logits_close(torch.cat([prefill, decode]), hf_logits(hf, ids))


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    model = load_hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_kvloom_serve_runs_the_out_of_tree_model(gemma_dir: Path, tmp_path: Path) -> None:
    site = install_distribution(PLUGIN_SRC, tmp_path)
    args = [str(gemma_dir), "--max-model-len", "64", "--skip-tokenizer-init", "--disable-log-stats"]
    with KvloomServer(args, tmp_path, [site]) as server:
        for prompt in PROMPTS:
            response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                                       "ignore_eos": True, "logprobs": 0})  # fmt: skip
            assert response.status_code == 200, response.text
            tokens = [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]
            assert tokens == hf_greedy(gemma_dir, prompt)
        assert "GemmaForCausalLM" in server.log()


def test_without_the_plugin_gemma_is_not_supported(gemma_dir: Path) -> None:
    # KVLOOM_PLUGINS lists what may load: the platform and backend, not kvloom-gemma
    # (which a development install may have installed).
    code = f"from kvloom.testing import resolve_engine_config; resolve_engine_config(model={str(gemma_dir)!r})"
    done = subprocess.run([sys.executable, "-c", code], env=plugin_env([], KVLOOM_PLUGINS="cpu,CPU_ATTN"),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "model architecture ['GemmaForCausalLM']" in done.stderr and "is not supported" in done.stderr
