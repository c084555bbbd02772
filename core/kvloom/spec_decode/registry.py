"""Speculative-decoding proposers by method, and the resolution of ``--speculative-config``.

``available_proposers()``: kvloom's own (``ngram``, ``draft_model``, ``eagle3``, ``mtp``) and the
plugins of ``kvloom.spec_decode_proposers``. ``resolve_speculative`` (called by
``create_engine_config``) turns the user's checked JSON object into the engine's
``SpeculativeConfig``: the proposer class that serves its ``method``, the draft model's
section, and every reason the engine cannot speculate so (the proposer's ``validate`` and
the engine's own: no pipeline parallelism, no pooling), as one ``ValueError``.
"""

from __future__ import annotations

import logging
from typing import Any

from kvloom.config import EngineConfig, ModelConfig, SpeculativeConfig
from kvloom.spec_decode.proposer import ModelProposer, SpecDecodeProposer

logger = logging.getLogger(__name__)


def builtin_proposers() -> dict[str, type[SpecDecodeProposer]]:
    """kvloom's own proposers, by NAME."""
    from kvloom.spec_decode.draft_model import DraftModelProposer
    from kvloom.spec_decode.eagle3 import Eagle3Proposer
    from kvloom.spec_decode.mtp import MTPProposer
    from kvloom.spec_decode.ngram import NgramProposer

    return {cls.NAME: cls for cls in (NgramProposer, DraftModelProposer, Eagle3Proposer, MTPProposer)}


def available_proposers() -> dict[str, type[SpecDecodeProposer]]:
    """NAME -> proposer class: the built-in ones and the loaded plugins."""
    from kvloom import plugins

    return plugins.spec_decode_proposers(builtin_proposers())


def proposer_for_method(method: str, proposers: dict[str, type[SpecDecodeProposer]]) -> type[SpecDecodeProposer]:
    """The proposer serving ``method`` (its NAME or one of its ``methods``)."""
    for cls in proposers.values():
        if cls.serves(method):
            return cls
    names = sorted({n for cls in proposers.values() for n in (cls.NAME, *cls.methods)})
    raise ValueError(f"speculative_config.method: {method!r} is not a speculative method kvloom knows "
                     f"(allowed: {', '.join(names)})")  # fmt: skip


def draft_model_section(path: str, quantization: str | None, config: EngineConfig) -> ModelConfig:
    """The ``ModelConfig`` of a draft checkpoint: its own HF config and architecture, the
    target's dtype and ``max_model_len``."""
    from kvloom.loader.model_source import load_hf_config, resolve_model_source
    from kvloom.quantization.selection import quantization_for_engine

    target = config.model
    load_format = "dummy" if config.load.load_format == "dummy" else "auto"
    try:
        source = resolve_model_source(path, load_format)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: {exc}") from None
    hf_config = load_hf_config(source)
    architectures = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "unknown")]
    return ModelConfig(
        model=source.path, tokenizer=None, skip_tokenizer_init=True, served_model_name=source.display_name,
        hf_config=hf_config, architecture=architectures[0], dtype=target.dtype, max_model_len=target.max_model_len,
        seed=target.seed, runner="generate",
        quantization=quantization_for_engine(hf_config, quantization, config.device.platform, target.dtype,
                                             tensor_parallel_size=config.parallel.tensor_parallel_size,
                                             gguf=source.kind == "gguf", model=source.path),
    )  # fmt: skip


def _engine_reasons(speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
    """What the engine itself cannot do with speculation, whatever the proposer."""
    reasons = []
    if config.parallel.pipeline_parallel_size > 1:
        reasons.append("pipeline parallelism is not supported with speculative decoding "
                       f"(pipeline_parallel_size {config.parallel.pipeline_parallel_size})")  # fmt: skip
    if config.model.runner != "generate":
        reasons.append(f"the {config.model.runner} runner samples no tokens to speculate on")
    tp = config.parallel.tensor_parallel_size
    if speculative.draft_tensor_parallel_size not in (None, tp):
        reasons.append(f"draft_tensor_parallel_size {speculative.draft_tensor_parallel_size} must equal "
                       f"tensor_parallel_size ({tp}): the draft runs sharded like the target")  # fmt: skip
    return reasons


def _kv_cache_reasons(cls: type[SpecDecodeProposer], config: EngineConfig) -> list[str]:
    """A draft model's layers share the target's blocks as one group of full attention:
    not yet beside a target with several KV-cache groups (sliding-window or hybrid layers)."""
    if not issubclass(cls, ModelProposer):
        return []
    from kvloom.kv_cache.spec import engine_kv_cache_config

    kv = engine_kv_cache_config(config)
    if kv.num_groups == 1:
        return []
    return [f"a draft model beside a target with several KV-cache groups ({kv.describe()}) is not supported yet "
            "(method 'ngram' runs on it)"]  # fmt: skip


def resolve_speculative(user: dict[str, Any] | None, config: EngineConfig) -> SpeculativeConfig | None:
    """The engine's ``SpeculativeConfig`` for the user's checked ``--speculative-config``
    (None: off), or a ``ValueError`` naming every reason it cannot run."""
    if user is None:
        return None
    speculative = SpeculativeConfig.from_user(user)
    cls = proposer_for_method(speculative.method, available_proposers())
    if speculative.method != cls.NAME:
        logger.info("speculative_config.method %r is served by the %r proposer", speculative.method, cls.NAME)
    speculative.method = cls.NAME
    speculative.proposer = cls
    if speculative.model is not None and cls.NAME != "mtp":
        speculative.draft = draft_model_section(speculative.model, speculative.quantization, config)
    reasons = _engine_reasons(speculative, config) + _kv_cache_reasons(cls, config) + cls.validate(speculative, config)
    if reasons:
        raise ValueError(f"speculative_config (method {cls.NAME!r}): " + "; ".join(reasons))
    logger.info("Speculative decoding: %s, %d draft tokens per step%s", cls.NAME, speculative.num_speculative_tokens,
                f", draft {speculative.draft.model}" if speculative.draft is not None else "")  # fmt: skip
    return speculative
