"""The tokenizer of a model: from its HF directory, a tokenizer directory, or the
metadata of a GGUF file (converted once and cached by ``model_source.gguf_hf_dir``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvloom.config import ModelConfig
from kvloom.loader.model_source import gguf_hf_dir

logger = logging.getLogger(__name__)

#: Files any one of which makes a directory a tokenizer directory for transformers.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def tokenizer_dir(path: str | Path) -> Path:
    """The directory transformers loads the tokenizer of ``path`` (a directory or a
    ``.gguf`` file) from; raises if it has no tokenizer files."""
    path = Path(path)
    directory = gguf_hf_dir(path) if path.is_file() and path.suffix == ".gguf" else path
    if not directory.is_dir() or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer: {path} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); "
            "pass a tokenizer directory with --tokenizer, or --skip-tokenizer-init to serve token ids only"
        )
    return directory


def get_tokenizer(model_config: ModelConfig) -> Any | None:
    """The transformers tokenizer of the model, or None with ``skip_tokenizer_init``."""
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    source = model_config.tokenizer or model_config.model
    directory = tokenizer_dir(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load the tokenizer of {source}: {e}") from e
    if model_config.chat_template is not None:
        tokenizer.chat_template = model_config.chat_template  # --chat-template, for every chat path
    logger.debug("Loaded tokenizer %s (%d tokens) from %s", type(tokenizer).__name__, len(tokenizer), directory)
    return tokenizer
