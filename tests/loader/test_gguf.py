"""GGUF weights: name mapping, llama.cpp's Q/K permutation, dequantization, the
dequantized-weight cache, and the shipped SmolLM2 GGUF against HF's GGUF loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvloom.loader import gguf_loader
from kvloom.loader.gguf_loader import gguf_weights, unpermute_qk
from kvloom.loader.model_loader import checkpoint_weight_names, get_model
from kvloom.loader.model_source import default_model_path, gguf_cache_dir
from kvloom.loader.tokenizer import get_tokenizer
from tests.helpers.model_fixtures import (
    PagedRunner,
    assert_logits_close,
    hf_logits,
    load_hf_model,
    make_test_engine_config,
    tiny_model_dir,
)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

#: Storage type per kind of tensor in the tiny files: every dequantizer kvloom relies on.
QTYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q4_1,
    "attn_q": Q.F32,  # exact, so the un-permutation is checked bit for bit
    "attn_k": Q.F32,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama-architecture models."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(model_dir: Path, path: Path, arch_name: str) -> dict[str, torch.Tensor]:
    """Write the HF checkpoint of ``model_dir`` as a GGUF file the way llama.cpp would;
    returns the HF-named tensors a correct reader must produce (quantization included)."""
    config = load_hf_model(model_dir).config
    state = {k: v.numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch_name)
    expected = {}
    for hf_name, array in state.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        kind = gguf_base.split(".")[-1]
        qtype = QTYPES.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16  # rows shorter than a quantization block: llama.cpp falls back too
        stored = array
        if arch_name == "llama" and kind == "attn_q":
            stored = llama_cpp_permute(array, config.num_attention_heads)
        elif arch_name == "llama" and kind == "attn_k":
            stored = llama_cpp_permute(array, config.num_key_value_heads)
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(f"{gguf_base}.{suffix}", data, raw_dtype=qtype)
        # Quantization acts within rows and the permutation moves whole rows, so the
        # expected tensor is the row-wise quantize/dequantize round trip of the original.
        expected[hf_name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


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
