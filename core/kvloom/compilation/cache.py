"""Where compiled artefacts live: ``$KVLOOM_CACHE_DIR/torch_compile/<key>``.

The key hashes what the generated code depends on: the model's HF config and dtype, the
compilation settings, the attention backend, the platform, and the kvloom and torch
versions. Inductor's and Triton's own caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``) are pointed into that directory (for the whole process), so a
second start with the same key loads the compiled pieces instead of compiling them again
(Dynamo still traces the model at every start). The CUDA graphs themselves cannot be
stored; they are captured at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

import kvloom
from kvloom.config import EngineConfig
from kvloom.utils import kvloom_cache_dir

logger = logging.getLogger(__name__)


def compile_cache_key(config: EngineConfig) -> str:
    """A hex digest of everything the compiled code depends on (see the module docstring)."""
    model, comp = config.model, config.compilation
    hf = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
    hf.pop("_name_or_path", None)  # the same config in another directory compiles the same
    parts = {
        "architecture": model.architecture,
        "hf_config": hf,
        "dtype": str(model.dtype),
        "runner": model.runner,
        "compilation": {
            "use_inductor": comp.use_inductor,
            "splitting_ops": comp.splitting_ops,
            "custom_ops": comp.custom_ops,
        },  # not cudagraph_mode: graphs wrap the compiled pieces, which are the same for every mode
        "kv_cache_dtype": config.cache.cache_dtype,
        "attention_backend": getattr(config.attention.backend, "NAME", config.attention.backend.__name__),
        "platform": config.device.platform.name,
        "kvloom": kvloom.__version__,
        "torch": torch.__version__,
    }
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def compile_cache_dir(config: EngineConfig) -> Path:
    """``$KVLOOM_CACHE_DIR/torch_compile/<compile_cache_key>``."""
    return kvloom_cache_dir() / "torch_compile" / compile_cache_key(config)


def use_compile_cache(config: EngineConfig) -> Path:
    """Point Inductor's and Triton's caches at this config's directory and return it."""
    path = compile_cache_dir(config)
    path.mkdir(parents=True, exist_ok=True)
    # Always set: Inductor writes its default into os.environ itself (for its compile
    # workers) once it has run, so a value found there need not be the user's.
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = str(path / sub)
    logger.info("Compile cache: %s", path)
    return path
