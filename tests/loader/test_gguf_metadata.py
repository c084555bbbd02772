"""GGUF metadata without gguf-py's slow reader: the header read against gguf-py's
``GGUFReader``, the config and tokenizer kvloom converts against transformers' own GGUF
loading, and the cache directory keyed by the file's content."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvloom.loader import gguf_metadata
from kvloom.loader.gguf_header import StringArray, read_gguf_header
from kvloom.loader.gguf_metadata import GENERIC_ARCHITECTURES, gguf_cache_dir, gguf_config_dict, gguf_hf_dir
from tests.helpers.tokenizer_fixtures import byte_level_tokenizer

gguf = pytest.importorskip("gguf")

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = ["Hello world, this is a test.", "The quick brown fox <|im_end|> jumps", "  spaces\tand\nlines 12345"]


def _byte_level_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and llama.cpp token types of a small byte-level BPE (ids in order)."""
    state = json.loads(byte_level_tokenizer().backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    specials = {t["content"] for t in state["added_tokens"]}
    return tokens, merges, [3 if t in specials else 1 for t in tokens]  # 3: control, 1: normal


#: A small, consistent model: a value for every key transformers maps for some architecture.
HPARAMS = {"context_length": 256, "block_count": 2, "feed_forward_length": 128, "embedding_length": 64,
           "rope.dimension_count": 16, "rope.freq_base": 10000.0, "attention.head_count": 4,
           "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5, "attention.key_length": 16,
           "attention.sliding_window": 32, "expert_count": 4, "expert_used_count": 2}  # fmt: skip


def _hparams(architecture: str) -> dict[str, Any]:
    """The values of the keys transformers maps for ``architecture``, and one it does not."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    model_type = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(architecture, architecture)
    keys = [key for key in GGUF_CONFIG_MAPPING[model_type] if key != "vocab_size"]  # that one: the vocabulary's
    missing = set(keys) - set(HPARAMS)
    assert not missing, f"HPARAMS needs values for {architecture}: {missing}"
    return {"attention.layer_norm_epsilon": 0.5, **{key: HPARAMS[key] for key in keys}}


def write_metadata_gguf(path: Path, architecture: str, tied: bool = True, name: str | None = None,
                        hparams: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """A GGUF file with a real config and byte-level tokenizer in its metadata and two tiny tensors."""
    tokens, merges, types = _byte_level_vocabulary()
    writer = gguf.GGUFWriter(str(path), architecture)
    if name is not None:
        writer.add_name(name)
    for key, value in (hparams if hparams is not None else _hparams(architecture)).items():
        if isinstance(value, float):
            writer.add_float32(f"{architecture}.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"{architecture}.{key}", value)
        else:
            writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.ones((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ----------------------------------------------------------------- the header


def test_header_matches_gguf_py(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", "déf"])
    writer.add_custom_alignment(64)
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((5,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = read_gguf_header(path)
    meta = header.metadata
    assert (meta["t.u8"], meta["t.i16"], meta["t.i64"], meta["t.bool"]) == (7, -3, -(2**40), True)
    assert meta["t.str"] == "héllo"
    assert meta["t.f64"] == 0.1 and meta["t.ints"] == [1, 2, 3] and meta["t.strs"] == StringArray(3)
    assert header.architecture == "llama" and meta["general.alignment"] == 64
    reader = gguf.GGUFReader(str(path))
    assert header.tensor_names == ("a.weight", "b.weight")
    for info, tensor in zip(header.tensors, reader.tensors):
        assert info.ggml_type == int(tensor.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert header.data_offset + info.offset == int(tensor.data_offset)


@pytest.mark.parametrize("content", [b"", b"GGML" + bytes(40), b"GGUF" + bytes(3)])
def test_header_of_a_file_that_is_not_gguf(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        read_gguf_header(path)


def test_header_of_a_truncated_file(tmp_path):
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="cut.gguf is not a valid GGUF file"):
        read_gguf_header(cut)


# ----------------------------------------------------------------- config and tokenizer


def _transformers_config(path: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()


def _kvloom_config(path: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(gguf_hf_dir(path)).to_dict()


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}


@pytest.mark.parametrize("architecture", GENERIC_ARCHITECTURES)
def test_config_matches_transformers(tmp_path, cache, architecture):
    path = write_metadata_gguf(tmp_path / f"{architecture}.gguf", architecture, tied=architecture != "qwen3",
                               name=f"Tiny {architecture} model")  # fmt: skip
    assert gguf_config_dict(read_gguf_header(path)) is not None
    assert _comparable(_kvloom_config(path)) == _comparable(_transformers_config(path))


@pytest.mark.parametrize(
    "name,hparams",
    [("mistral", None), ("Mistral 7B", None), (None, {"block_count": 2, "attention.head_count_kv": [2]})],
)
def test_config_rules_of_transformers(tmp_path, cache, name, hparams):
    """The Mistral rename (``general.name`` exactly "mistral"), and a one-element array
    read as its element."""
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama", name=name, hparams=hparams)
    kvloom, reference = _kvloom_config(path), _transformers_config(path)
    assert _comparable(kvloom) == _comparable(reference)
    assert kvloom["model_type"] == ("mistral" if name == "mistral" else "llama")


def test_other_architectures_go_through_transformers(tmp_path, cache, caplog):
    path = write_metadata_gguf(tmp_path / "s.gguf", "starcoder2", hparams={"block_count": 2, "embedding_length": 8})
    assert gguf_config_dict(read_gguf_header(path)) is None
    with caplog.at_level("INFO", logger="kvloom.loader.gguf_metadata"):
        config = _kvloom_config(path)
    assert "through transformers" in caplog.text
    assert _comparable(config) == _comparable(_transformers_config(path))


def test_tokenizer_matches_transformers(tmp_path, cache):
    from transformers import AutoTokenizer

    path = write_metadata_gguf(tmp_path / "m.gguf", "llama")
    ours = AutoTokenizer.from_pretrained(gguf_hf_dir(path))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(reference)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == ("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    assert ours.all_special_tokens == reference.all_special_tokens


def test_file_without_a_tokenizer(tmp_path, cache, caplog):
    path = tmp_path / "no-tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in _hparams("llama").items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"llama.{key}", value)
    writer.add_vocab_size(16)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level("WARNING"):
        directory = gguf_hf_dir(path)
    assert "No tokenizer could be read" in caplog.text
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == 16


# ----------------------------------------------------------------- the cache directory


def test_cache_dir_is_keyed_by_content(tmp_path, cache):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_metadata_gguf(tmp_path / "a" / "m.gguf", "llama")
    copy = tmp_path / "b" / "m.gguf"
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(10**18, 10**18))  # another mtime, another path: the same content
    assert gguf_cache_dir(first) == gguf_cache_dir(copy)
    assert gguf_hf_dir(first) == gguf_hf_dir(copy)

    other = write_metadata_gguf(tmp_path / "a" / "other.gguf", "llama", tied=False)
    other.replace(copy)  # the same path and name, other bytes
    assert gguf_cache_dir(copy) != gguf_cache_dir(first)


def test_content_hash_is_remembered_per_file_state(tmp_path, cache, monkeypatch):
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama")
    hashed: list[Path] = []
    real_hash = gguf_metadata._hash_file
    monkeypatch.setattr(gguf_metadata, "_hash_file", lambda p, size: hashed.append(p) or real_hash(p, size))
    content_id = gguf_metadata.gguf_content_id(path)
    assert gguf_metadata.gguf_content_id(path) == content_id and len(hashed) == 1  # remembered
    os.utime(path, ns=(10**18, 10**18))  # touched: hashed again, the same content
    assert gguf_metadata.gguf_content_id(path) == content_id and len(hashed) == 2
