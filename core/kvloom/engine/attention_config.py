"""The attention section of the ``EngineConfig``: which backend serves the model's
attention (for an MLA model, a decode and a prefill backend) and the block size, and
whether they still serve the config once the platform and plugins adjusted it.

Selection is ``attention/selector.py`` (the platform's priority order, every candidate
validated with reasons); this module describes the model's attention to it
(``selector_config``) and applies the block-size negotiation of
``docs/attention_backends.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvloom.attention.backend import DEFAULT_BLOCK_SIZE, AttentionSelectorConfig
from kvloom.attention.selector import select_attention_backend
from kvloom.config import AttentionConfig
from kvloom.kv_cache.spec import sliding_window_of
from kvloom.models.interface import has_attention_sinks
from kvloom.models.registry import ModelRegistry

if TYPE_CHECKING:
    from kvloom.config import EngineConfig, ModelConfig
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)


def attention_config(args: EngineArgs, platform: type[Platform], model: ModelConfig) -> tuple[AttentionConfig, int]:
    """The selected attention backend (for an MLA model, the decode backend and a prefill
    backend) and the block size."""
    selector = selector_config(platform, model, args.kv_cache_dtype, args.block_size)
    selection = select_attention_backend(platform, selector, requested=args.attention_backend)
    backend = selection.selected
    if selection.tune is not None and args.attention_backend is None:
        measured = ", ".join(f"{c.name} {c.measured_ms:.3f} ms" for c in selection.candidates if c.measured_ms is not None)
        logger.info("Attention backend %s: the fastest valid one measured by `kvloom backends tune` (%s; %s)",
                    backend.NAME, selection.tune.created, measured)  # fmt: skip
    prefill_backend = None
    if model.use_mla:
        # MLA models get a second backend for the prefill phase, chosen the same way; it
        # never owns the cache, so the decode backend's block size stands.
        prefill_selector = selector_config(platform, model, args.kv_cache_dtype, selection.block_size, "prefill")
        prefill_backend = select_attention_backend(
            platform, prefill_selector, requested=args.mla_prefill_backend
        ).selected
        logger.info("MLA backends: decode %s, prefill %s", backend.NAME, prefill_backend.NAME)
    elif args.mla_prefill_backend is not None:
        raise ValueError(
            f"mla_prefill_backend={args.mla_prefill_backend!r}: model {model.architecture} does not use MLA "
            "(only MLA models, e.g. DeepSeek-V2/V3, have a separate prefill backend)"
        )
    # Block-size negotiation (docs/attention_backends.md): a user's --block-size was part
    # of the selection config, so every candidate that cannot serve it was already
    # invalid; without one, selection validated the backends without a block size and
    # the chosen backend decides it.
    block_size = selection.block_size
    if args.block_size is None and block_size != DEFAULT_BLOCK_SIZE:
        logger.info(
            "Block size %d chosen by attention backend %s (it supports %s); set --block-size to override.",
            block_size,
            backend.NAME,
            backend.describe_block_sizes(),
        )
    attention = AttentionConfig(
        requested_backend=args.attention_backend,
        backend=backend,
        requested_prefill_backend=args.mla_prefill_backend,
        prefill_backend=prefill_backend,
    )
    return attention, block_size


def selector_config(
    platform: type[Platform], model: ModelConfig, kv_cache_dtype: str, block_size: int | None, mla_phase: str = "decode"
) -> AttentionSelectorConfig:
    """The selection config of the model's attention; for an MLA model, of one phase
    (``mla_phase``): decode over the latent rows (one KV head of ``kv_lora_rank +
    qk_rope_head_dim``), prefill over decompressed per-head K/V."""
    if model.use_mla:
        dims = model.mla_dims
        decode = mla_phase == "decode"
        return AttentionSelectorConfig(
            head_size=dims.latent_size if decode else dims.qk_head_dim,
            dtype=model.dtype,
            kv_cache_dtype=kv_cache_dtype,
            # The prefill phase never reads the paged cache (the core decompresses the
            # cached prefix for it), so its block sizes do not matter.
            block_size=block_size if decode else None,
            use_mla=True,
            mla_phase=mla_phase,
            v_head_dim=None if decode else dims.v_head_dim,
            device_type=platform.device_type,
            device_capability=platform.get_device_capability(),
            num_heads=dims.num_heads,
            num_kv_heads=1 if decode else dims.num_heads,
        )
    windows = [sliding_window_of(model.hf_config, i, model.max_model_len) for i in range(model.num_layers)]
    windows = [w for w in windows if w is not None]
    text_config = getattr(model.hf_config, "text_config", None) or model.hf_config
    return AttentionSelectorConfig(
        head_size=model.head_size,
        dtype=model.dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        use_mla=False,
        device_type=platform.device_type,
        device_capability=platform.get_device_capability(),
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        sliding_window=min(windows, default=None),
        has_sinks=has_attention_sinks(ModelRegistry.load_model_cls(model.architecture)),
        # HF's name of Gemma 2's attention logit soft-cap.
        logits_soft_cap=getattr(text_config, "attn_logit_softcapping", None),
    )


def backend_problems(config: EngineConfig) -> list[str]:
    """Why the selected backends cannot serve ``config`` as it is now (its block size, KV
    cache dtype, ...): empty when they can."""
    platform, model, cache = config.device.platform, config.model, config.cache
    reasons = config.attention.backend.validate_configuration(
        selector_config(platform, model, cache.cache_dtype, cache.block_size)
    )
    prefill = config.attention.prefill_backend
    if prefill is not None:
        prefill_reasons = prefill.validate_configuration(
            selector_config(platform, model, cache.cache_dtype, cache.block_size, "prefill")
        )
        reasons += [f"(MLA prefill backend {prefill.NAME}) {r}" for r in prefill_reasons]
    return reasons
