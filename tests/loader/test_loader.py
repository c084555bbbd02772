"""Weight loading from HF directories (safetensors single/sharded, .bin), dummy weights,
tokenizers, and the model registry path of ``get_model``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvloom.layers.layernorm import RMSNorm
from kvloom.loader.model_loader import checkpoint_weight_names, get_model
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from kvloom.loader.tokenizer import get_tokenizer
from kvloom.loader.weight_utils import DUMMY_WEIGHT_RANGE, find_weight_files
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.qwen2 import Qwen2ForCausalLM
from kvloom.models.registry import ModelRegistry
from kvloom.models.weights import LLAMA_STACKED_PARAMS, checkpoint_names, load_checkpoint_weights
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



class LoadsNothingForCausalLM(LlamaForCausalLM):
    """An out-of-tree model whose ``load_weights`` reads the checkpoint and keeps nothing."""

    def load_weights(self, weights):
        for _ in weights:
            pass
        return set()


def _sloppy(skipped: str, returns=None, base: type[torch.nn.Module] = LlamaForCausalLM):
    """A ``base`` model whose hand-written loader skips ``skipped`` (an HF name) without
    noticing, and returns ``returns(loaded names)``."""

    class SloppyModel(base):
        def load_weights(self, weights):
            targets = checkpoint_names(self, self.stacked_params)
            loaded = set()
            with torch.no_grad():
                for name, tensor in weights:
                    target = targets.get(name)
                    if name == skipped or target is None:
                        continue
                    loader = getattr(target.module, "weight_loader", None)
                    if loader is not None:
                        loader(target.param, tensor, target.shard)
                    else:
                        target.param.copy_(tensor)
                    loaded.add(name)
            return loaded if returns is None else returns(loaded)

    return SloppyModel


def _config_for(monkeypatch, arch: str, model_cls, model_dir=None, **kwargs):
    monkeypatch.setitem(ModelRegistry._models, arch, model_cls)
    config = make_test_engine_config(model_dir or tiny_model_dir("llama"), **kwargs)
    config.model.architecture = arch
    return config


def test_load_weights_that_loads_nothing_is_an_error_naming_the_weights(monkeypatch):
    """vLLM: "Following weights were not initialized from checkpoint: {...}"."""
    config = _config_for(monkeypatch, "LoadsNothingForCausalLM", LoadsNothingForCausalLM)
    expected = len(checkpoint_weight_names(get_model(make_test_engine_config(tiny_model_dir("llama")), "cpu")))
    with pytest.raises(ValueError) as err:
        get_model(config, "cpu")
    message = str(err.value)
    assert "Following weights were not initialized from checkpoint" in message
    assert f"({expected} of {expected})" in message and config.model.model in message
    assert "LoadsNothingForCausalLM.load_weights" in message
    assert "model.embed_tokens.weight" in message and "(first 10 shown)" in message
    # The same model with dummy weights loads: there is no checkpoint to compare with.
    dummy = _config_for(monkeypatch, "LoadsNothingForCausalLM", LoadsNothingForCausalLM, load_format="dummy")
    get_model(dummy, "cpu")


@pytest.mark.parametrize(
    "skipped",
    ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
)
def test_load_weights_that_misses_one_tensor_names_it(monkeypatch, skipped):
    """One shard of a merged projection (k of qkv_proj, up of gate_up_proj) is one missing
    checkpoint weight, named by its HF name."""
    config = _config_for(monkeypatch, "SloppyForCausalLM", _sloppy(skipped))
    with pytest.raises(ValueError, match=rf"not initialized from checkpoint .*\(1 of \d+\): {skipped}$"):
        get_model(config, "cpu")


def _as_parameter_names(loaded: set[str]) -> set[str]:
    merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
    return {".".join(merged.get(part, part) for part in name.split(".")) for name in loaded}


def test_complete_hand_written_loader_passes_whichever_names_it_returns(monkeypatch):
    """Names may be HF names (the contract) or the model's own parameter names; a tied
    LM head counts as loaded with the embedding."""
    get_model(_config_for(monkeypatch, "CompleteForCausalLM", _sloppy("")), "cpu")
    get_model(_config_for(monkeypatch, "ParamNamesForCausalLM", _sloppy("", returns=_as_parameter_names)), "cpu")
    tied = _config_for(monkeypatch, "TiedForCausalLM", _sloppy("", base=Qwen2ForCausalLM), tiny_model_dir("qwen2"))
    model = get_model(tied, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_weights_must_return_the_names(monkeypatch):
    config = _config_for(monkeypatch, "NoneForCausalLM", _sloppy("", returns=lambda loaded: None))
    with pytest.raises(TypeError, match=r"SloppyModel\.load_weights returned None; it must return"):
        get_model(config, "cpu")


def test_merged_projections_without_stacked_params_are_explained(monkeypatch):
    """The engine reads the model's ``stacked_params`` to count merged projections as
    loaded: load_checkpoint_weights alone is not enough, and the error says so."""

    class NoStackedParams(LlamaForCausalLM):
        stacked_params = ()

        def load_weights(self, weights):  # type: ignore[no-untyped-def]
            return load_checkpoint_weights(self, weights, LLAMA_STACKED_PARAMS)

    config = _config_for(monkeypatch, "NoStackedForCausalLM", NoStackedParams)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*NoStackedParams has merged projections \(gate_up_proj, "
                                         r"qkv_proj\) but no stacked_params: set the class attribute"):  # fmt: skip
        get_model(config, "cpu")


def test_a_model_type_transformers_does_not_know_needs_its_config_registered(tmp_path):
    from transformers import AutoConfig, PretrainedConfig

    model_dir = tmp_path / "toy"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "kvloom_test_toy", "architectures": ["ToyForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 128,
    }))  # fmt: skip
    source = resolve_model_source(str(model_dir))
    with pytest.raises(ValueError, match=r"model type 'kvloom_test_toy' of .* is unknown to transformers: .*"
                                         r"AutoConfig\.register\('kvloom_test_toy', YourConfig\)"):  # fmt: skip
        load_hf_config(source)

    class ToyConfig(PretrainedConfig):
        model_type = "kvloom_test_toy"

    AutoConfig.register("kvloom_test_toy", ToyConfig)
    config = load_hf_config(source)
    assert isinstance(config, ToyConfig) and (config.hidden_size, config.architectures) == (64, ["ToyForCausalLM"])
