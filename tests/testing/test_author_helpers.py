"""kvloom.testing's helpers for plugin authors' test setup (kvloom.testing.models, .lora,
.install): tiny checkpoints with real tokenizers made offline, HF references, PEFT
adapters, and the installed-distribution environment; ``import kvloom.testing`` stays
light (transformers, tokenizers, peft and httpx load only when these helpers run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvloom.testing.install import plugin_env
from kvloom.testing.lora import LORA_TARGET_MODULES, edit_adapter_config, make_adapter
from kvloom.testing.models import (
    EOS_TOKEN,
    TINY_ARCHITECTURES,
    build_tokenizer,
    hf_greedy_tokens,
    random_prompts,
    save_tiny_checkpoint,
    tiny_hf_config,
    tiny_model_dir,
)

HEAVY = ("transformers", "tokenizers", "peft", "httpx", "fastapi", "uvicorn")


def test_import_kvloom_testing_stays_light() -> None:
    code = f"import sys, kvloom.testing; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_tiny_checkpoint_of_any_architecture_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GraniteConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = GraniteConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, attention_bias=True)  # fmt: skip
    out = save_tiny_checkpoint(config, tmp_path / "granite", seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.chat_template
    assert tokenizer.decode(tokenizer("Héllo wörld").input_ids) == "Héllo wörld"  # byte-level: any text
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0  # biases are not left at 0
    assert not torch.all(params["model.norm.weight"] == 1)  # nor norms at 1


def test_tiny_architectures_and_prompts() -> None:
    assert TINY_ARCHITECTURES == ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3",
                                  "gpt_oss")  # fmt: skip
    assert tiny_hf_config("qwen3").head_dim == 24 and tiny_hf_config("llama", num_hidden_layers=1).num_hidden_layers == 1
    with pytest.raises(ValueError, match="not a tiny architecture"):
        tiny_hf_config("gpt2")
    prompts = random_prompts(100)
    assert [len(p) for p in prompts] == [5, 16, 23, 41, 64] and prompts == random_prompts(100)
    assert all(3 <= t < 100 for p in prompts for t in p)
    assert [len(p) for p in random_prompts(50, lengths=(2, 3), seed=1)] == [2, 3]
    assert len(build_tokenizer()) == 320


def test_adapter_is_a_normal_peft_adapter_that_changes_the_model(tmp_path: Path) -> None:
    base = tiny_model_dir("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=5, r=4, target_modules=["q_proj", "v_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["peft_type"] == "LORA" and config["r"] == 4
    assert set(LORA_TARGET_MODULES) >= set(config["target_modules"])
    from safetensors.torch import load_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(w.abs().sum() > 0 for name, w in weights.items() if "lora_B" in name)
    prompt = [[5, 17, 33, 48]]
    assert hf_greedy_tokens(base, prompt, 6, adapter_dir=adapter) != hf_greedy_tokens(base, prompt, 6)
    assert edit_adapter_config(adapter, peft_type="IA3")["peft_type"] == "IA3"


def test_plugin_env_puts_the_sites_first_and_drops_kvloom_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_PLUGINS", "cpu")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = plugin_env([Path("/site-a"), "/site-b"], KVLOOM_PLATFORM="cpu")
    assert env["PYTHONPATH"].split(":") == ["/site-a", "/site-b", "/elsewhere"]
    assert "KVLOOM_PLUGINS" not in env and env["KVLOOM_PLATFORM"] == "cpu"
