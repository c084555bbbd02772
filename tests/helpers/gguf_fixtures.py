"""Tiny GGUF files written the way llama.cpp's converter writes them (for the GGUF loader's
and the GGUF quantization method's tests)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kvloom.testing.models import load_hf_model

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


def write_tiny_gguf(
    model_dir: Path, path: Path, arch_name: str, qtypes: Mapping[str, int] = QTYPES, quantize=None
) -> dict[str, torch.Tensor]:
    """Write the HF checkpoint of ``model_dir`` as a GGUF file the way llama.cpp would, each
    2-D tensor in its kind's type of ``qtypes`` (``attn_q``, ``ffn_down``, ...; F32 when not
    named; F16 for rows shorter than the type's block, as llama.cpp falls back); returns the
    HF-named tensors a correct reader must produce (quantization included). ``quantize``
    (``(float array, type) -> stored array``, default gguf-py's) may write types gguf-py
    cannot (K-quants)."""
    config = load_hf_model(model_dir).config
    state = {k: v.numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch_name)
    expected = {}
    quantize = quantize or gguf.quants.quantize
    for hf_name, array in state.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        kind = gguf_base.split(".")[-1]
        qtype = Q(qtypes.get(kind, Q.F32)) if array.ndim == 2 else Q.F32
        if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16  # rows shorter than a quantization block: llama.cpp falls back too
        stored = array
        if arch_name == "llama" and kind == "attn_q":
            stored = llama_cpp_permute(array, config.num_attention_heads)
        elif arch_name == "llama" and kind == "attn_k":
            stored = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(f"{gguf_base}.{suffix}", quantize(stored, qtype), raw_dtype=qtype)
        # Quantization acts within rows and the permutation moves whole rows, so the
        # expected tensor is the row-wise quantize/dequantize round trip of the original.
        round_trip = gguf.quants.dequantize(quantize(array, qtype), qtype)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(round_trip).reshape(array.shape).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
