"""GGUF weights: name mapping, llama.cpp's Q/K permutation, dequantization, the
dequantized-weight cache, and the shipped SmolLM2 GGUF against HF's GGUF loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloom.loader import gguf_loader
from kvloom.loader.gguf_loader import gguf_weights, unpermute_qk
from kvloom.loader.model_loader import checkpoint_weight_names, get_model
from kvloom.loader.model_source import default_model_path, gguf_cache_dir
from kvloom.loader.tokenizer import get_tokenizer
from tests.helpers.gguf_fixtures import llama_cpp_permute, write_tiny_gguf
from tests.helpers.model_fixtures import (
    PagedRunner,
    assert_logits_close,
    hf_logits,
    load_hf_model,
    make_test_engine_config,
    tiny_model_dir,
)

gguf = pytest.importorskip("gguf")


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    for n_head in (1, 2, 6):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    bias = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, 4), 4), bias)


@pytest.mark.parametrize("arch,arch_name", [("llama", "llama"), ("qwen3", "qwen3"), ("qwen2", "qwen2")])
def test_tiny_gguf_weights_and_logits(tmp_path, monkeypatch, arch, arch_name):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_model_dir(arch)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(model_dir, gguf_path, arch_name)

    config = make_test_engine_config(model_dir)
    model = get_model(config, "cpu")
    names = checkpoint_weight_names(model)
    cache_file = gguf_cache_dir(gguf_path) / gguf_loader._CACHE_FILE
    assert not cache_file.exists()
    first = dict(gguf_weights(gguf_path, config.model.hf_config, names))
    assert cache_file.is_file()
    cached = dict(gguf_weights(gguf_path, config.model.hf_config, names))
    assert first.keys() == set(names) == cached.keys()
    for name in names:
        assert torch.equal(first[name], expected[name]), name
        assert torch.equal(cached[name], expected[name]), name

    # The loaded model computes what HF computes with the same (quantized) weights.
    model.load_weights(first.items())
    hf = load_hf_model(model_dir)
    hf.load_state_dict({**hf.state_dict(), **expected})
    prompt = [7, 100, 3, 45, 45, 9, 300, 12, 5, 77, 8]
    out = PagedRunner(model, config).step({"r": prompt})["r"]
    assert_logits_close(out, hf_logits(hf, prompt))


def test_weight_cache_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVLOOM_GGUF_WEIGHT_CACHE", "0")
    model_dir = tiny_model_dir("llama")
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model_dir, gguf_path, "llama")
    config = make_test_engine_config(model_dir)
    names = checkpoint_weight_names(get_model(config, "cpu"))
    assert len(dict(gguf_weights(gguf_path, config.model.hf_config, names))) == len(names)
    assert not (gguf_cache_dir(gguf_path) / gguf_loader._CACHE_FILE).exists()


def test_smollm2_gguf_matches_hf_gguf_loader():
    """The default model end to end: config, tokenizer and weights from the GGUF, logits
    of a chat prompt against transformers' own GGUF loading (fp32)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    config = make_test_engine_config(path, max_model_len=256, block_size=16)
    assert config.model.architecture == "LlamaForCausalLM" and config.load.source_kind == "gguf"
    tokenizer = get_tokenizer(config.model)
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(ids, add_special_tokens=False)
    model = get_model(config, "cpu")
    out = PagedRunner(model, config, max_requests=1).step({"r": ids})["r"]

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    expected = hf_logits(hf, ids)
    assert_logits_close(out, expected)
    assert tokenizer.decode(int(out[-1].argmax())).strip() == "The"


def test_a_truncated_gguf_file_is_named_when_its_tensors_are_read(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model_dir("llama"), path, "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 64])  # the header is whole, the data is not
    config = make_test_engine_config(tiny_model_dir("llama"))
    names = checkpoint_weight_names(get_model(config, "cpu"))
    with pytest.raises(ValueError, match=r"cut.gguf: GGUF file is truncated: tensor .* ends past the end of the file"):
        list(gguf_weights(cut, config.model.hf_config, names, raw=True))


def test_raw_tensors_are_the_stored_bytes_in_hf_row_order(tmp_path, monkeypatch):
    """What a GGUF quantization method gets: GGUFTensors (type, raw rows with llama.cpp's Q/K
    permutation undone) that dequantize to what the float path gives; 1-D tensors as floats;
    one content key per file, the same for a copy under another path."""
    from kvloom.loader.gguf_file import GGUFTensor
    from kvloom.loader.gguf_metadata import gguf_content_id

    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_model_dir("llama")
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(model_dir, path, "llama")
    config = make_test_engine_config(model_dir)
    names = checkpoint_weight_names(get_model(config, "cpu"))
    raw = dict(gguf_weights(path, config.model.hf_config, names, raw=True))
    assert raw.keys() == set(names)
    for name, tensor in raw.items():
        if tensor.dim() == 1:
            assert type(tensor) is torch.Tensor and torch.equal(tensor, expected[name]), name
            continue
        assert (
            isinstance(tensor, GGUFTensor) and tensor.raw.dtype == np.uint8 and tensor.raw.shape[0] == tensor.shape[0]
        )
        assert torch.equal(tensor.materialize(), expected[name]), name
        assert torch.equal(tensor.narrow(0, 3, 5).materialize(), expected[name][3:8]), name
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.gguf_name == "blk.0.attn_q.weight" and q.type_name == "F32"
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert q.content_key == gguf_content_id(path) == gguf_content_id(copy)
