"""``--generation-config`` and ``--chat-template``: what a request gets that it leaves unset.

Generation config, as in vLLM: ``auto`` (the default) reads the model directory's
``generation_config.json`` and takes its ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) as the defaults of
requests that do not set them; ``vllm`` (or ``kvloom``) ignores the file (kvloom's own
defaults); a folder path reads that folder's ``generation_config.json``.

Chat template, as in vLLM: a path to a Jinja file, or the template itself inline.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvloom.utils import read_json_object

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"

#: generation_config.json key -> SamplingParams name.
GENERATION_DEFAULT_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

#: ``--generation-config`` values that mean "kvloom's own defaults".
BUILTIN_GENERATION_CONFIGS = ("vllm", "kvloom")


def generation_defaults(setting: str, model_path: str | Path) -> dict[str, Any]:
    """The default sampling parameters ``setting`` (``--generation-config``) gives for the
    model at ``model_path`` (an HF directory or a .gguf file, which has no such file)."""
    if setting in BUILTIN_GENERATION_CONFIGS:
        return {}
    if setting == "auto":
        folder = Path(model_path)
        if not folder.is_dir():
            return {}
    else:
        folder = Path(setting)
        if not folder.is_dir():
            raise ValueError(f"generation_config: {setting!r} is not a folder (allowed: auto, vllm, kvloom, or a "
                             f"folder holding {GENERATION_CONFIG_FILE})")  # fmt: skip
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"generation_config: {folder} has no {GENERATION_CONFIG_FILE}")
        return {}
    try:
        values = read_json_object(path)
    except ValueError as exc:
        raise ValueError(f"generation_config: {exc}") from None
    defaults = {name: values[key] for key, name in GENERATION_DEFAULT_KEYS.items() if values.get(key) is not None}
    if defaults:
        logger.info("Default sampling parameters from %s: %s (--generation-config vllm ignores them)", path, defaults)
    return defaults


def resolve_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``: a file's contents, or ``value`` itself
    when it is an inline Jinja template (it has ``{{`` or ``{%``)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass  # a long inline template is not a valid path
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor an inline Jinja template")
