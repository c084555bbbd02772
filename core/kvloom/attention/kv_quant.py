"""An fp8 KV cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``): keys and values
stored in 8 bits with one scale per tensor, half the bytes of a 16-bit cache.

A layer's key (value) scale ``k_scale`` (``v_scale``) comes from the checkpoint
(``self_attn.k_scale`` / ``v_scale``, or one ``kv_scale`` for both, as llm-compressor and
AutoFP8 write them) or is 1.0. The cache holds ``fp8(clamp(k * (1 / k_scale)))`` and a
kernel reads ``fp8 * k_scale``. The reciprocal is rounded to float32 once on the host and
the quantization multiplies by it (no division), so every backend, and the float64
reference of the conformance suite, store bit-identical caches: the elementwise product
of a 16-bit value and a float32 is exact in float32, and the cast to fp8 rounds to
nearest even, in torch and in Triton alike.

Attention reads the keys and values as the cache holds them, the step's own included:
a backend that attends a fresh prompt to its ``key``/``value`` inputs directly (without a
cache read) quantizes and dequantizes them first, so a token's output does not depend
on whether its keys were written in this step or an earlier one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: ``--kv-cache-dtype`` values of an fp8 cache -> the torch dtype (``fp8`` is e4m3, as in vLLM).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a KV cache of ``--kv-cache-dtype cache_dtype`` (``"auto"``: the
    model's): what a block's bytes are counted in, so an fp8 cache holds twice the tokens
    of a 16-bit one in the same memory."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[cache_dtype]
    dtype = getattr(torch, cache_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not a torch dtype name")
    return dtype


def is_fp8_kv_cache(cache: torch.Tensor | torch.dtype) -> bool:
    """Whether a KV cache (or its dtype) is fp8."""
    dtype = cache.dtype if isinstance(cache, torch.Tensor) else cache
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def inverse_kv_scale(scale: float) -> float:
    """``1 / scale`` rounded to float32: what the cache write multiplies by."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV cache of ``dtype`` holds it: for fp8, ``fp8(clamp(x * inverse_kv_scale(scale)))``
    (saturating at the format's largest value); other dtypes a plain cast."""
    if not is_fp8_kv_cache(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * inverse_kv_scale(scale)).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values read back in ``dtype`` (the model's): ``x * scale``, computed
    in float32 and rounded once, for an fp8 cache; a plain cast otherwise."""
    if not is_fp8_kv_cache(x):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def log_kv_cache_scales(model: nn.Module, cache_dtype: str) -> None:
    """For an fp8 KV cache, log where the attention layers' scales came from (the
    checkpoint, or 1.0: values beyond the fp8 range then saturate)."""
    if cache_dtype not in FP8_KV_CACHE_DTYPES:
        return
    layers = [m for m in model.modules() if isinstance(getattr(m, "kv_scales_loaded", None), set)]
    scaled = sum(1 for m in layers if m.kv_scales_loaded)
    if scaled:
        logger.info("KV cache %s: k/v scales from the checkpoint for %d of %d attention layers (1.0 for the rest)",
                    cache_dtype, scaled, len(layers))  # fmt: skip
    else:
        logger.info("KV cache %s: the checkpoint has no k/v scales; using 1.0 (keys and values beyond %g saturate)",
                    cache_dtype, torch.finfo(FP8_KV_CACHE_DTYPES[cache_dtype]).max)  # fmt: skip
