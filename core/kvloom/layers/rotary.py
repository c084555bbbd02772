"""Rotary position embedding (RoPE) with HF transformers' scaling types.

The inverse frequencies are computed with the same float32 formulas as
``transformers.modeling_rope_utils`` (so cos/sin tables are bit-identical to HF's), then
a cos/sin table over every position up to ``max_position`` is precomputed once; the
forward pass only gathers rows by position (no per-token Python, no host sync).

Supported ``rope_type`` values:

* ``default``: ``theta ** (-2i/d)``.
* ``linear``: default frequencies divided by ``factor``.
* ``llama3``: Llama 3.1's wavelength-dependent smoothing.
* ``yarn``: YaRN's ramp between interpolated and extrapolated frequencies, with the
  attention factor folded into cos/sin as HF does (DeepSeek's ``mscale`` /
  ``mscale_all_dim`` included; its softmax-scale correction is ``deepseek_softmax_scale``).
* ``dynamic`` (dynamic NTK): HF recomputes the base whenever the running sequence grows
  beyond ``max_position_embeddings``, which a paged cache shared by many sequences
  cannot do. kvloom uses one fixed table computed for ``max_position`` tokens. This is
  exactly HF's result when ``max_model_len <= max_position_embeddings`` (the base is then
  unscaled); beyond that it is a fixed NTK scaling for the whole context (vLLM's choice).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvloom.layers.custom_ops import get_custom_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def rotary_qk_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch code of the ``rotary_qk`` op: a rotated contiguous copy of ``x [N, heads,
    D]`` with ``cos``/``sin`` ``[N, 1, D/2]``, in HF's rotate-half layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # Same arithmetic as HF's x*cos + rotate_half(x)*sin, without materialising rotate_half.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qk_norm_rotary_torch(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """The torch code of the ``qk_norm_rotary`` op (Qwen3's attention input): ``x [N,
    heads, D]`` holds the query heads, then the key heads; each group is RMS-normalised per
    head (``q_weight`` / ``k_weight``, HF's ``q_norm`` / ``k_norm``), then both are rotated
    as ``rotary_qk``. Returns a new contiguous ``[N, heads, D]``."""
    from kvloom.layers.layernorm import rms_norm_torch

    q = rms_norm_torch(x[:, :num_q_heads], q_weight, eps)
    k = rms_norm_torch(x[:, num_q_heads:], k_weight, eps)
    return rotary_qk_torch(torch.cat((q, k), dim=1), cos, sin)


def get_rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The model's RoPE parameters as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads ``config.rope_parameters`` (transformers >= 5) or ``rope_scaling`` plus
    ``rope_theta`` (older configs), applying transformers' defaults. A config with
    parameters per attention type (Gemma 3: ``{"full_attention": {...},
    "sliding_attention": {...}}``) gives those of ``layer_type`` (default: full attention).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        kind = layer_type or "full_attention"
        if kind not in params:
            raise ValueError(f"rope_parameters has no entry for {kind!r} layers (has {', '.join(params)})")
        params = params[kind]
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    if params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        else:
            params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_softmax_scale(params: dict[str, Any], qk_head_dim: int) -> float:
    """DeepSeek's attention softmax scale: ``qk_head_dim ** -0.5``, times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the model uses scaled RoPE with a
    ``mscale_all_dim`` (DeepSeek-V2/V3's YaRN: the rotary cos/sin carry
    ``mscale / mscale_all_dim``, the scores the rest)."""
    scale = qk_head_dim**-0.5
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(params: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max

    mscale_of = yarn_mscale

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes num_rotations over the original context.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _dynamic_inv_freq(params: dict[str, Any], dim: int, max_position: int, max_position_embeddings: int) -> torch.Tensor:
    base = params["rope_theta"]
    factor = params["factor"]
    seq_len = max(max_position, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_position: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for ``params``."""
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise NotImplementedError(f"rope partial_rotary_factor={partial} is not supported (only 1.0)")
    dim = head_dim
    if rope_type == "default":
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "linear":
        return _base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, dim, max_position_embeddings)
    if rope_type == "dynamic":
        return _dynamic_inv_freq(params, dim, max_position, max_position_embeddings), 1.0
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE (HF's "rotate half" layout) to query and key given token positions.

    ``cos``/``sin`` tables ``[max_position, head_dim // 2]`` are computed in float32 and
    stored in the dtype active at construction (the model dtype), matching HF, which
    casts cos/sin to the activation dtype before rotating.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        max_position_embeddings: int,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_type = rope_parameters["rope_type"]
        dtype, device = torch.get_default_dtype(), torch.get_default_device()
        # Computed on the CPU whatever the target device, so tables do not depend on it.
        with torch.device("cpu"):
            inv_freq, attention_scaling = compute_inv_freq(
                rope_parameters, head_dim, max_position, max_position_embeddings
            )
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            cos = (freqs.cos() * attention_scaling).to(dtype)
            sin = (freqs.sin() * attention_scaling).to(dtype)
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` rows for ``positions [N]``, shaped ``[N, 1, head_dim // 2]``;
        computed once per forward pass and shared by all layers."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    @staticmethod
    def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated contiguous copy of ``x [N, heads, D]`` (query and key heads may come
        in one tensor: they rotate the same way)."""
        if (op := get_custom_op("rotary_qk")) is not None:
            return op(x, cos, sin)  # type: ignore[return-value]
        return rotary_qk_torch(x, cos, sin)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [N, Hq, D]``, ``key [N, Hk, D]`` -> rotated copies (same shapes)."""
        cos, sin = self.cos_sin(positions)
        return self.rotate_heads(query, cos, sin), self.rotate_heads(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, rope_type={self.rope_type}"

