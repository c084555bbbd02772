"""The contract of a multi-head latent attention (MLA, DeepSeek-V2/V3) backend: the latent
cache layout, the two phases and what a backend implements for each.

MLA caches one *latent* vector per token per layer instead of per-head keys and values:
``c_kv`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) followed by the rotated shared
key ``k_pe`` (``qk_rope_head_dim`` values). The cache of one layer is
``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``: no head dimension.

The MLA layer (``kvloom.attention.mla_layer.MLAAttention``) does everything that is the
same for every backend, and hands a backend only the attention of each phase:

- **Decode** (requests with ``query_len == 1``): the absorbed query ``[q_nope @ W_UK,
  q_pe]`` attends directly over the latent cache (keys = the whole latent row, values =
  its first ``L`` values, one KV "head" shared by all query heads).
- **Prefill** (``query_len > 1``): causal variable-length attention over per-head ``K``
  and ``V`` that the layer decompressed from the latent rows (bottom-right aligned: query
  ``j`` of a request with ``c`` context tokens sees keys ``0 .. c + j``).

What an MLA backend implements (``MLAAttentionBackend``, ``MLAAttentionImpl``; see
docs/attention_backends.md, "MLA backends"):

a. ``MLAAttentionImpl.write_latent`` (a torch default is provided): store ``[c_kv, k_pe]``
   of the step's tokens at their slots (``-1`` = padding, skip).
b. ``MLAAttentionImpl.forward_decode`` for backends whose ``mla_phases`` contain
   ``"decode"`` and ``forward_prefill`` for those with ``"prefill"``.

An MLA model gets two backends, chosen independently by the same priority-ordered
validation (``kvloom.attention.selector``): the decode backend (``--attention-backend``),
which also owns the cache layout and writes it, and the prefill backend
(``--mla-prefill-backend``). One backend may serve both. CUDA graphs capture pure decode
steps only, so the decode backend's ``cudagraph_support`` is the one the graph dispatcher
reads (``config.attention.backend``). Each phase backend's builder receives that phase's
requests only (``kvloom.attention.mla_metadata`` splits the step).
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvloom.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionSelectorConfig
from kvloom.attention.kv_write import copy_rows_skipping_invalid

MLA_DECODE = "decode"
"""The decode phase: requests with ``query_len == 1``, absorbed attention over the latent cache."""
MLA_PREFILL = "prefill"
"""The prefill phase: requests with ``query_len > 1``, dense attention over decompressed K/V."""
MLA_PHASES = (MLA_DECODE, MLA_PREFILL)
"""Both phases, in the order ``MLAAttentionBackend.mla_phases`` declares them by default."""


@dataclass(frozen=True)
class MLADims:
    """The static shape of one MLA layer."""

    num_heads: int
    """Query heads (H)."""
    kv_lora_rank: int
    """Width of the compressed KV latent ``c_kv`` (L; 512 for DeepSeek-V2/V3)."""
    qk_nope_head_dim: int
    """Per-head query/key width without RoPE (128 for DeepSeek)."""
    qk_rope_head_dim: int
    """Width of the rotated part, shared by all heads on the key side (R; 64 for DeepSeek)."""
    v_head_dim: int
    """Per-head value width (128 for DeepSeek)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLADims.{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLADims.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def latent_size(self) -> int:
        """Values cached per token per layer: ``kv_lora_rank + qk_rope_head_dim`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the prefill path: ``qk_nope + qk_rope`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_extra(self) -> dict[str, int]:
        """The dims as ``AttentionLayerSpec.extra`` entries (what MLA builders read)."""
        return {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }

    @classmethod
    def from_spec(cls, spec: AttentionLayerSpec) -> MLADims:
        """The dims an MLA builder's ``spec`` carries (``spec.extra``)."""
        e = spec.extra
        return cls(spec.num_heads, e["kv_lora_rank"], e["qk_nope_head_dim"], e["qk_rope_head_dim"], e["v_head_dim"])


def split_latent_cache(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's latent cache ``(num_blocks, block_size, L + R)`` as
    ``(c_kv [.., L], k_pe [.., R])``."""
    return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]


def write_latent_torch(
    kv_cache: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[kv_c_normed, k_pe]`` of token ``t`` at slot ``slot_mapping[t]`` of a latent
    cache ``(num_blocks, block_size, L + R)``; ``-1`` slots (padding) are skipped. No host
    sync, safe inside a CUDA graph."""
    n = slot_mapping.shape[0]
    if kv_c_normed.shape[0] < n or k_pe.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but kv_c/k_pe have {kv_c_normed.shape[0]}/{k_pe.shape[0]} rows")
    width = kv_cache.shape[-1]
    if kv_c_normed.shape[-1] + k_pe.shape[-1] != width:
        raise ValueError(
            f"latent width: kv_c ({kv_c_normed.shape[-1]}) + k_pe ({k_pe.shape[-1]}) != cache width {width}"
        )
    slots = slot_mapping.to(torch.int64)
    rows = torch.cat([kv_c_normed[:n], k_pe[:n]], dim=-1)
    copy_rows_skipping_invalid(kv_cache.view(-1, width), slots, rows, slots >= 0)


class MLAAttentionImpl(ABC):
    """One MLA layer's kernels, built once per layer by ``MLAAttention`` with the layer's
    ``MLADims``, softmax ``scale`` and KV-cache dtype.

    A backend implements the phases its ``MLAAttentionBackend.mla_phases`` declares:
    ``forward_decode`` for ``"decode"``, ``forward_prefill`` for ``"prefill"`` (selection
    never routes a phase to a backend that does not declare it). The decode backend's
    impl also writes the cache (``write_latent``; the torch default serves any backend
    using the contract's layout).
    """

    impl_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """KV-cache dtypes this impl reads and writes (others are refused by the constructor)."""

    def __init__(self, dims: MLADims, scale: float, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype not in self.impl_kv_cache_dtypes:
            allowed = ", ".join(self.impl_kv_cache_dtypes)
            raise NotImplementedError(
                f"{type(self).__name__}: kv_cache_dtype {kv_cache_dtype} not supported (supports {allowed})"
            )
        self.dims = dims
        self.num_heads = dims.num_heads
        self.kv_lora_rank = dims.kv_lora_rank
        self.qk_rope_head_dim = dims.qk_rope_head_dim
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype

    def write_latent(
        self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store the step's latent rows: ``kv_c_normed [N, L]`` and rotated ``k_pe [N, R]``
        (N may exceed ``len(slot_mapping)``; rows past it are ignored) at ``slot_mapping
        [n]`` (int64, ``block * block_size + offset``; ``-1`` = skip) of ``kv_cache``
        (this backend's ``get_kv_cache_shape``). Must not sync with the host (CUDA graphs)."""
        write_latent_torch(kv_cache, kv_c_normed, k_pe, slot_mapping)

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any, out: torch.Tensor
    ) -> torch.Tensor:
        """Decode attention over the paged latent cache, one query token per request.

        - ``q`` ``[B, H, L + R]``: the absorbed query ``[q_nope @ W_UK, rotated q_pe]``.
        - ``kv_cache``: this layer's latent cache (the step's tokens already written).
        - ``attn_metadata``: what this backend's builder built from the decode requests'
          ``CommonAttentionMetadata`` (``B`` requests, ``query_start_loc = arange(B+1)``,
          ``seq_lens`` including the new token, ``block_table`` rows of these requests).
        - ``out`` ``[B, H, L]``: write ``softmax(scale * q . K^T) @ V`` per request and head,
          with ``K`` = the ``seq_lens[i]`` cached latent rows (all ``L + R`` values) and
          ``V`` = their first ``L`` values. Return ``out``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement MLA decode")

    def forward_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any, out: torch.Tensor
    ) -> torch.Tensor:
        """Causal variable-length attention of the prefill requests (dense, per head).

        - ``q`` ``[Nq, H, qk_nope + R]``: the step's query rows of the prefill requests,
          request ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``.
        - ``k`` ``[Nk, H, qk_nope + R]``, ``v`` ``[Nk, H, v_head_dim]``: every position of
          each request's sequence (its cached prefix decompressed from the latent cache,
          then the step's tokens); request ``i`` owns ``seq_lens[i]`` rows starting at
          ``cumsum(seq_lens)[i-1]``.
        - ``attn_metadata``: what this backend's builder built from the prefill requests'
          ``CommonAttentionMetadata`` (query_start_loc and seq_lens as above).
        - ``out`` ``[Nq, H, v_head_dim]``: query ``j`` of request ``i`` attends to key
          positions ``<= seq_lens[i] - query_len_i + j`` (bottom-right causal), with
          ``scale``. Return ``out``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement MLA prefill")


class MLAAttentionBackend(AttentionBackend):
    """The base class of MLA backends: ``is_mla`` and the latent cache layout.

    Declare ``mla_phases`` (``("decode",)``, ``("prefill",)`` or both) and return an
    ``MLAAttentionImpl`` subclass from ``get_impl_cls``. The builder
    (``get_builder_cls``) is built once per phase the backend is selected for, with an
    ``AttentionLayerSpec`` whose ``extra`` holds the ``MLADims`` (``MLADims.from_spec``):
    for decode ``num_kv_heads=1, head_size=L+R``; for prefill ``num_kv_heads=H,
    head_size=qk_nope+R``. Its ``build`` receives that phase's requests only.

    The selection config's ``head_size`` is the phase's: ``L + R`` (576) for decode,
    ``qk_nope + R`` (192) for prefill; ``v_head_dim`` is ``config.v_head_dim``.
    """

    is_mla = True
    mla_phases: ClassVar[tuple[str, ...]] = MLA_PHASES
    """The phases the impl implements: ``"decode"`` (``forward_decode``; the decode backend
    also owns the cache) and/or ``"prefill"`` (``forward_prefill``). Selection gives a
    phase only to backends declaring it (reason: "MLA prefill not supported ...")."""
    max_head_size = 1024  # the decode head is the whole latent row (576 for DeepSeek)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """``(num_blocks, block_size, head_size)`` with ``head_size = L + R`` and
        ``num_kv_heads == 1``: one latent row per token."""
        if num_kv_heads != 1:
            raise ValueError(f"MLA latent cache: num_kv_heads must be 1, got {num_kv_heads}")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent cache as ``[block, offset, 1, L + R]`` for both key and value (MLA's
        values are the first ``L`` values of the same rows; ``split_latent_cache`` splits them)."""
        view = kv_cache.unsqueeze(2)
        return view, view

    @classmethod
    def validate_configuration(cls, config: AttentionSelectorConfig) -> list[str]:
        reasons = super().validate_configuration(config)
        phase = config.mla_phase
        if config.use_mla and phase is not None and phase not in cls.mla_phases:
            reasons.append(f"MLA {phase} not supported (implements {', '.join(cls.mla_phases) or 'no phase'})")
        return reasons
