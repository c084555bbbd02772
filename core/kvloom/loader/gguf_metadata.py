"""A GGUF file's cache directory, and its metadata as an HF model directory.

* ``gguf_cache_dir``: one directory per file *content* under ``KVLOOM_CACHE_DIR/gguf``
  (``<stem>-<first 16 hex digits of the file's SHA-256>``), shared by every environment
  and every copy of the file: the dequantized weights go there once. Hashing reads the
  whole file (a fraction of a second for the default model), so the hash is remembered
  per path, size, modification time and inode in ``gguf/ids/``.
* ``gguf_hf_dir``: ``config.json`` and the tokenizer files, converted from the GGUF
  metadata once per file and transformers version (``hf-<transformers version>`` inside
  the cache directory: tokenizer files written by one transformers version are not always
  readable by another).

The config is built from the header (``gguf_header``, milliseconds) with transformers'
own GGUF key table (``GGUF_CONFIG_MAPPING``) and the rules its GGUF reader applies to the
architectures listed in ``GENERIC_ARCHITECTURES``. For other architectures transformers
adds rules of its own, so their config comes from ``AutoConfig`` (through gguf-py's reader:
seconds to tens of seconds, once per file). The tokenizer comes from
``PreTrainedTokenizerFast.from_pretrained(gguf_file=...)``, transformers' GGUF tokenizer
conversion (under a second for the default model with transformers 5).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvloom.loader.gguf_header import GGUFHeader, StringArray, read_gguf_header
from kvloom.utils import kvloom_cache_dir

logger = logging.getLogger(__name__)

#: GGUF architectures whose transformers config follows transformers' key table and its
#: generic rules only (renames, tied embeddings, vocabulary size); kvloom builds their
#: config itself (``tests/loader/test_gguf_metadata.py`` checks each against transformers).
GENERIC_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
#: llama.cpp's architecture names that transformers spells differently.
_RENAMED_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
#: GGUF files of these carry only the text model of a multimodal family.
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
#: Bytes hashed per read (and per step of the progress bar).
_HASH_CHUNK = 16 * 2**20


# ----------------------------------------------------------------- the cache directory


def gguf_content_id(gguf_path: str | Path) -> str:
    """The SHA-256 (hex) of the file's bytes, remembered per path, size, mtime and inode."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    where = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_dev}:{stat.st_ino}"
    memo = kvloom_cache_dir() / "gguf" / "ids" / hashlib.sha256(where.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    content_id = _hash_file(gguf_path, stat.st_size)
    _write_atomically(memo, content_id)
    return content_id


def _hash_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=size, desc=f"Hashing {path.name}", unit="B", unit_scale=True, delay=1.0,
                                     dynamic_ncols=True) as bar:  # fmt: skip
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def gguf_cache_dir(gguf_path: str | Path) -> Path:
    """The cache directory of a GGUF file's content (dequantized weights, converted
    metadata): the same for every copy of the file and every environment."""
    gguf_path = Path(gguf_path)
    return kvloom_cache_dir() / "gguf" / f"{gguf_path.stem}-{gguf_content_id(gguf_path)[:16]}"


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file (readers never see half a file); a cache
    directory that cannot be written only costs speed."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("Could not write the cache file %s: %s", path, e)
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------- the HF directory


def gguf_hf_dir(gguf_path: str | Path) -> Path:
    """An HF-style directory (config.json + tokenizer files) converted once from the GGUF
    metadata and cached."""
    gguf_path = Path(gguf_path)
    transformers_version = importlib.metadata.version("transformers")
    out = gguf_cache_dir(gguf_path) / f"hf-{transformers_version}"
    if (out / "config.json").is_file():
        return out
    start = time.perf_counter()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        config = gguf_config_dict(read_gguf_header(gguf_path))
        with _steps(gguf_path.name, 2) as step:
            if config is None:
                _write_transformers_config(gguf_path, tmp)
            else:
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            step()
            _write_tokenizer(gguf_path, tmp)
            step()
        # Files move in one by one, config.json last: it marks the conversion complete.
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted the GGUF metadata of %s in %.2f s (cached in %s)", gguf_path.name,
                time.perf_counter() - start, out)  # fmt: skip
    return out


@contextmanager
def _steps(name: str, total: int) -> Iterator[Any]:
    """A bar over the conversion's steps, shown only once it has taken a second."""
    with tqdm(total=total, desc=f"Converting the GGUF metadata of {name}", unit="step", delay=1.0,
              dynamic_ncols=True) as bar:  # fmt: skip
        yield lambda: bar.update(1)


def _write_transformers_config(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig

    logger.info("Reading the config of %s through transformers (its GGUF architecture has rules of its own there; "
                "seconds to tens of seconds, once per file)", gguf_path.name)  # fmt: skip
    AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as e:
        # The weights may still be served from token ids (skip_tokenizer_init) or with a
        # separate tokenizer; get_tokenizer reports the missing files if one is needed.
        logger.warning("No tokenizer could be read from the metadata of %s: %s", gguf_path.name, e)
        return
    tokenizer.save_pretrained(out)


# ----------------------------------------------------------------- the config


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any] | None:
    """The transformers config dict of a GGUF file of one of ``GENERIC_ARCHITECTURES``
    (None for the others): what transformers' GGUF reader makes of the same metadata."""
    from transformers.integrations import ggml

    key_table: dict[str, dict[str, Any]] = ggml.GGUF_CONFIG_MAPPING
    defaults: dict[str, dict[str, Any]] = getattr(ggml, "GGUF_CONFIG_DEFAULTS_MAPPING", {})
    metadata, architecture = header.metadata, header.architecture
    if architecture not in GENERIC_ARCHITECTURES:
        return None
    model_type = _RENAMED_ARCHITECTURES.get(architecture, architecture)
    if architecture == "llama" and metadata.get("general.name") == "mistral":
        model_type = "mistral"  # llama.cpp writes Mistral as llama (transformers' rule, to the letter)
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in header.tensor_names}
    for key, value in (defaults.get(model_type) or defaults.get(architecture) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, name = key.replace(architecture, model_type).partition(".")
        hf_key = key_table.get(prefix, {}).get(name)
        if hf_key is None or hf_key == -1:
            continue
        if isinstance(value, StringArray):
            return None  # a config value kvloom's header read left unread: let transformers read it
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers reads a one-element array as its element
        if isinstance(value, str):
            value = value.replace(architecture, model_type)
        config[hf_key] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    written = config.setdefault("model_type", model_type)
    config["model_type"] = _TEXT_MODEL_TYPES.get(written, written)
    return config
