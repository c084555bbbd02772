"""Weight loading from HF directories (safetensors single/sharded, .bin), dummy weights,
tokenizers, and the model registry path of ``get_model``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvloom.loader.model_loader import checkpoint_weight_names, get_model
from kvloom.loader.tokenizer import get_tokenizer
from kvloom.loader.weight_utils import DUMMY_WEIGHT_RANGE, find_weight_files
from kvloom.layers.layernorm import RMSNorm
from kvloom.models.registry import ModelRegistry
from tests.helpers.model_fixtures import (
    EOS_TOKEN,
    PagedRunner,
    load_hf_model,
    make_test_engine_config,
    make_tiny_model,
    tiny_model_dir,
)

PROMPT = [5, 99, 3, 200, 41, 7, 7, 12]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _copy_config_and_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if not p.name.endswith((".safetensors", ".bin")) and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)


@pytest.fixture(scope="module")
def reference_state() -> dict[str, torch.Tensor]:
    return _state(get_model(make_test_engine_config(tiny_model_dir("qwen3")), "cpu"))


def test_checkpoint_names_expand_merged_projections():
    model = get_model(make_test_engine_config(tiny_model_dir("qwen2")), "cpu")
    names = set(checkpoint_weight_names(model))
    assert "model.layers.1.self_attn.q_proj.bias" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    # Qwen2 fixture ties the LM head: the checkpoint needs only the embedding.
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert ModelRegistry.load_model_cls("MistralForCausalLM") is ModelRegistry.load_model_cls("LlamaForCausalLM")


def test_sharded_safetensors_load_like_single_file(tmp_path, reference_state):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    kind, files = find_weight_files(tmp_path)
    assert kind == "safetensors" and len(files) > 3
    state = _state(get_model(make_test_engine_config(tmp_path, skip_tokenizer_init=True), "cpu"))
    assert state.keys() == reference_state.keys()
    for name, tensor in reference_state.items():
        assert torch.equal(state[name], tensor), name


def test_pytorch_bin_checkpoint(tmp_path, reference_state):
    src = tiny_model_dir("qwen3")
    _copy_config_and_tokenizer(src, tmp_path)
    torch.save(load_file(src / "model.safetensors"), tmp_path / "pytorch_model.bin")
    assert find_weight_files(tmp_path)[0] == "pt"
    for load_format in ("auto", "pt"):
        state = _state(get_model(make_test_engine_config(tmp_path, load_format=load_format), "cpu"))
        for name, tensor in reference_state.items():
            assert torch.equal(state[name], tensor), name
    with pytest.raises(FileNotFoundError, match=r"no weight files \(\*.safetensors\)"):
        get_model(make_test_engine_config(tmp_path, load_format="safetensors"), "cpu")


def test_missing_and_misshapen_weights_are_named(tmp_path):
    src = tiny_model_dir("llama")
    _copy_config_and_tokenizer(src, tmp_path)
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        get_model(make_test_engine_config(tmp_path), "cpu")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj: checkpoint tensor for shard k has shape \(3, 3\)"):
        get_model(make_test_engine_config(tmp_path), "cpu")


def test_no_weight_files_is_a_clear_error(tmp_path):
    _copy_config_and_tokenizer(tiny_model_dir("llama"), tmp_path)
    with pytest.raises(FileNotFoundError, match="no weight files"):
        get_model(make_test_engine_config(tmp_path), "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights(dtype):
    config = make_test_engine_config(tiny_model_dir("qwen3"), dtype=dtype, load_format="dummy", seed=3)
    model = get_model(config, "cpu")
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 2 * 3 + 2 * 3 + 1  # input/post norms, q/k norms, final norm
    for name, p in model.named_parameters():
        assert p.dtype == dtype
        if id(p) in norms:
            assert torch.all(p == 1), name
        else:
            assert p.abs().max() <= DUMMY_WEIGHT_RANGE and p.std() > DUMMY_WEIGHT_RANGE / 10, name
    again = get_model(config, "cpu")
    other = get_model(make_test_engine_config(tiny_model_dir("qwen3"), dtype=dtype, load_format="dummy", seed=4), "cpu")
    for (name, p), q, r in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        if id(p) not in norms:
            assert not torch.equal(p, r), name
    logits = PagedRunner(model, config).step({"r": PROMPT})["r"]
    assert torch.isfinite(logits).all()


def test_get_model_uses_registry_and_loaded_weights_match_hf(tmp_path):
    model_dir = tiny_model_dir("llama")
    config = make_test_engine_config(model_dir)
    assert config.model.architecture == "LlamaForCausalLM"
    model = get_model(config, "cpu")
    hf = load_hf_model(model_dir)
    hf_state = hf.state_dict()
    ours = dict(model.named_parameters())
    q, k, v = ours["model.layers.0.self_attn.qkv_proj.weight"].split([64, 32, 32])
    assert torch.equal(q, hf_state["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, hf_state["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, hf_state["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(ours["lm_head.weight"], hf_state["lm_head.weight"])
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_unknown_architecture_is_a_clear_error(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path, with_tokenizer=False)
    config = make_test_engine_config(model_dir)
    config.model.architecture = "GPTNoSuchForCausalLM"
    with pytest.raises(ValueError, match="GPTNoSuchForCausalLM.*not supported; supported architectures: .*Qwen3"):
        get_model(config, "cpu")


def test_tokenizer_of_hf_dir_with_chat_template():
    config = make_test_engine_config(tiny_model_dir("mistral"))
    tok = get_tokenizer(config.model)
    text = "What is the capital of France? Paris, ünïcode!"
    ids = tok.encode(text)
    assert max(ids) < config.model.vocab_size
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == config.model.hf_config.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_tokenizer_is_a_clear_error_unless_skipped(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path, with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer files.*--skip-tokenizer-init"):
        get_tokenizer(make_test_engine_config(model_dir).model)
    assert get_tokenizer(make_test_engine_config(model_dir, skip_tokenizer_init=True).model) is None


def test_separate_tokenizer_directory(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "model", with_tokenizer=False)
    config = make_test_engine_config(model_dir)
    config.model.tokenizer = str(tiny_model_dir("qwen2"))
    assert get_tokenizer(config.model).eos_token == EOS_TOKEN
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_out_of_tree_architecture_registered_in_model_registry(tmp_path, monkeypatch):
    """A plugin's ``ModelRegistry.register_model`` is what ``get_model`` builds."""
    from kvloom.models.llama import LlamaForCausalLM

    class PluginLlama(LlamaForCausalLM):
        pass

    monkeypatch.setitem(ModelRegistry._models, "PluginLlamaForCausalLM", PluginLlama)
    config = make_test_engine_config(tiny_model_dir("llama"))
    config.model.architecture = "PluginLlamaForCausalLM"
    model = get_model(config, "cpu")
    assert type(model) is PluginLlama
    reference = get_model(make_test_engine_config(tiny_model_dir("llama")), "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
