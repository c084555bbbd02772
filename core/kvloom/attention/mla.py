"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the layer, its per-step metadata
and the contract an MLA backend implements.

MLA caches one *latent* vector per token per layer instead of per-head keys and values:
``c_kv`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) followed by the rotated shared
key ``k_pe`` (``qk_rope_head_dim`` values). The cache of one layer is
``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``: no head dimension.

Everything that is the same for every MLA backend happens here, once (as vLLM's
``MLACommonImpl``): the query projection (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm``
-> ``q_b_proj`` when ``q_lora_rank`` is set), ``kv_a_proj_with_mqa`` -> ``c_kv`` + ``k_pe``,
``kv_a_layernorm``, RoPE on ``q_pe``/``k_pe``, the split of ``kv_b_proj`` into ``W_UK``
(``[H, qk_nope, L]``) and ``W_UV`` (``[H, v, L]``), the split of a step into decode and
prefill requests, and ``o_proj``. The two phases compute attention differently:

- **Decode** (requests with ``query_len == 1``; data-movement friendly): ``W_UK`` is
  absorbed into the query, ``q_lat = [q_nope @ W_UK, q_pe]`` (``[B, H, L+R]``), attention
  runs directly over the latent cache (keys = the whole latent row, values = its first
  ``L`` values, one KV "head" shared by all query heads), and ``W_UV`` maps the latent
  output ``[B, H, L]`` back to ``[B, H, v]``. The decode backend's kernel does only the
  middle step.
- **Prefill** (``query_len > 1``; compute friendly): the latent rows of each request's
  whole sequence (its cached prefix read back from the latent cache, then the step's
  new tokens) are decompressed by ``kv_b_proj`` into per-head ``K = [k_nope, k_pe]``
  (``qk_nope + qk_rope`` wide) and ``V`` (``v_head_dim`` wide), and the prefill backend
  runs causal variable-length attention (bottom-right aligned: query ``j`` of a request
  with ``c`` context tokens sees keys ``0 .. c + j``).

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
reads (``config.attention.backend``).
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
)
from kvloom.attention.kv_write import copy_rows_skipping_invalid
from kvloom.forward_context import get_forward_context
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear
from kvloom.layers.rotary import RotaryEmbedding

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


# ---------------------------------------------------------------------- per-step metadata


@dataclass
class MLAPhaseBatch:
    """One phase's requests of a step."""

    common: CommonAttentionMetadata
    """The phase's requests alone (its own query_start_loc from 0, seq_lens, block table,
    slot mapping)."""
    token_rows: torch.Tensor | None
    """int64 rows of the phase's tokens in the step; ``None`` when they are the contiguous
    rows ``token_start : token_start + num_tokens`` (no gather)."""
    token_start: int
    num_tokens: int
    backend_metadata: Any
    """What the phase backend's builder built from ``common``."""

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The phase's rows of a step tensor ``x [N, ...]``."""
        if self.token_rows is None:
            return x[self.token_start : self.token_start + self.num_tokens]
        return x.index_select(0, self.token_rows)

    def scatter(self, dest: torch.Tensor, rows: torch.Tensor) -> None:
        """``dest[phase rows] = rows``."""
        if self.token_rows is None:
            dest[self.token_start : self.token_start + self.num_tokens] = rows
        else:
            dest.index_copy_(0, self.token_rows, rows)


@dataclass
class MLAPrefillBatch(MLAPhaseBatch):
    """The prefill requests, plus where their sequences' latent rows come from."""

    context_slots: torch.Tensor | None = None
    """int64 ``[sum(seq_lens)]``: the cache slot of every position of every prefill
    request's sequence, request by request; ``None`` when no request has context (the
    step's own latent rows are the whole sequences)."""


@dataclass
class MLAMetadata:
    """What every MLA layer of a step reads (built once per step)."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    """int64 ``[N]``: where each token's latent row goes (``-1`` = padding)."""
    decode: MLAPhaseBatch | None
    prefill: MLAPrefillBatch | None


def _subset_common(
    common: CommonAttentionMetadata, req_idx: np.ndarray, token_rows_np: np.ndarray, device: torch.device
) -> tuple[CommonAttentionMetadata, torch.Tensor | None, int]:
    """The requests ``req_idx`` of ``common`` as their own batch; also their token rows
    (``None`` when contiguous) and the first row."""
    qsl = common.query_start_loc_cpu.numpy()
    qlens = (qsl[1:] - qsl[:-1])[req_idx]
    seq_lens_cpu = common.seq_lens_cpu[torch.from_numpy(req_idx)]
    new_qsl = np.zeros(len(req_idx) + 1, dtype=np.int32)
    np.cumsum(qlens, out=new_qsl[1:])
    start = int(token_rows_np[0]) if len(token_rows_np) else 0
    contiguous = len(token_rows_np) == 0 or bool(np.all(np.diff(token_rows_np) == 1))
    idx = torch.from_numpy(req_idx).to(device, non_blocking=True)
    rows = None if contiguous else torch.from_numpy(token_rows_np).to(device, non_blocking=True)
    num_tokens = len(token_rows_np)
    slot_mapping = (
        common.slot_mapping[start : start + num_tokens] if rows is None else common.slot_mapping.index_select(0, rows)
    )
    qsl_cpu = torch.from_numpy(new_qsl)
    sub = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        seq_lens=common.seq_lens.index_select(0, idx),
        block_table=common.block_table.index_select(0, idx),
        slot_mapping=slot_mapping,
        num_reqs=len(req_idx),
        num_actual_tokens=num_tokens,
        max_query_len=int(qlens.max()) if len(qlens) else 0,
        max_seq_len=int(seq_lens_cpu.max()) if len(req_idx) else 0,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        causal=common.causal,
    )
    return sub, rows, start


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """The core's per-step builder of MLA models: splits the step into decode requests
    (``query_len == 1``) and prefill requests, and asks each phase backend's own builder
    for its metadata over its requests only.

    A pure-decode step (every request ``query_len == 1``, what CUDA graphs capture) hands
    the step's ``CommonAttentionMetadata`` unchanged to the decode builder (through
    ``build_for_cudagraph_capture`` when capturing or replaying), so that path needs no
    host work and no gathers.
    """

    def __init__(
        self,
        spec: AttentionLayerSpec,
        device: torch.device,
        max_num_blocks: int,
        decode_backend: type[AttentionBackend],
        prefill_backend: type[AttentionBackend],
    ) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.dims = MLADims.from_spec(spec)
        decode_spec = AttentionLayerSpec(
            num_heads=spec.num_heads, num_kv_heads=1, head_size=self.dims.latent_size, dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len, scale=spec.scale, extra=dict(spec.extra, mla_phase=MLA_DECODE),
        )  # fmt: skip
        prefill_spec = AttentionLayerSpec(
            num_heads=spec.num_heads, num_kv_heads=spec.num_heads, head_size=self.dims.qk_head_dim,
            dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype, block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, scale=spec.scale,
            extra=dict(spec.extra, mla_phase=MLA_PREFILL),
        )  # fmt: skip
        self.decode_builder = decode_backend.get_builder_cls()(decode_spec, device, max_num_blocks)
        self.prefill_builder = prefill_backend.get_builder_cls()(prefill_spec, device, max_num_blocks)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> MLAMetadata:
        if common.max_query_len != 1:
            raise ValueError(f"MLA CUDA graphs capture pure decode batches only (max_query_len {common.max_query_len})")
        md = self.decode_builder.build_for_cudagraph_capture(common)
        decode = MLAPhaseBatch(common, None, 0, common.num_reqs, md)
        return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, None)

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        qsl = common.query_start_loc_cpu.numpy()
        qlens = qsl[1:] - qsl[:-1]
        if common.max_query_len <= 1:
            decode = MLAPhaseBatch(common, None, 0, common.num_reqs, self.decode_builder.build(common))
            return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, None)
        is_decode = qlens == 1
        decode = prefill = None
        dec_idx = np.flatnonzero(is_decode)
        pre_idx = np.flatnonzero(~is_decode & (qlens > 0))
        if len(dec_idx):
            rows = qsl[dec_idx].astype(np.int64)
            sub, token_rows, start = _subset_common(common, dec_idx, rows, self.device)
            decode = MLAPhaseBatch(sub, token_rows, start, len(rows), self.decode_builder.build(sub))
        if len(pre_idx):
            rows = np.concatenate([np.arange(qsl[i], qsl[i + 1], dtype=np.int64) for i in pre_idx])
            sub, token_rows, start = _subset_common(common, pre_idx, rows, self.device)
            context_slots = self._context_slots(sub)
            prefill = MLAPrefillBatch(
                sub, token_rows, start, len(rows), self.prefill_builder.build(sub), context_slots=context_slots
            )
        return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, prefill)

    def _context_slots(self, sub: CommonAttentionMetadata) -> torch.Tensor | None:
        """Cache slots of every position of each prefill request's sequence, when any
        request has cached context (prefix-cache hits, earlier chunks); else ``None``."""
        seq_lens = sub.seq_lens_cpu.numpy().astype(np.int64)
        if np.array_equal(seq_lens, sub.query_lens_cpu.numpy()):
            return None
        bs = self.spec.block_size
        req = np.repeat(np.arange(len(seq_lens)), seq_lens)
        starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
        pos = np.arange(int(seq_lens.sum()), dtype=np.int64) - starts
        req_t = torch.from_numpy(req).to(self.device, non_blocking=True)
        pos_t = torch.from_numpy(pos).to(self.device, non_blocking=True)
        blocks = sub.block_table[req_t, pos_t // bs].to(torch.int64)
        return blocks * bs + pos_t % bs


# ---------------------------------------------------------------------- the layer


def _make_impl(backend: type[AttentionBackend], dims: MLADims, scale: float, kv_cache_dtype: str) -> MLAAttentionImpl:
    impl_cls: Any = backend.get_impl_cls()
    if not (isinstance(impl_cls, type) and issubclass(impl_cls, MLAAttentionImpl)):
        raise TypeError(f"MLA backend {backend.NAME}: get_impl_cls() must return an MLAAttentionImpl subclass")
    return impl_cls(dims, scale, kv_cache_dtype)


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention, whole: projections, norms, RoPE, the
    latent cache, both phases and ``o_proj`` (module names are HF's, so checkpoints load
    as they are). ``forward(hidden [N, hidden_size], cos_sin) -> [N, hidden_size]``.

    ``cos_sin`` is the rotary table rows of the step's positions (``RotaryEmbedding.
    cos_sin``, of width ``qk_rope_head_dim``). ``rope_interleaved``: the checkpoint keeps
    the rotary dims as interleaved pairs (DeepSeek-V2 always, V3 with ``rope_interleave``);
    they are de-interleaved before rotating, the same for ``q_pe`` and ``k_pe``, which
    leaves every score unchanged.

    The model runner treats it like ``Attention`` for the KV cache: ``num_kv_heads == 1``,
    ``head_size == L + R``, ``backend`` (the decode backend: it owns the cache layout),
    ``kv_cache`` (bound after allocation).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        dims: MLADims,
        q_lora_rank: int | None,
        scale: float,
        rms_norm_eps: float,
        decode_backend: type[AttentionBackend],
        prefill_backend: type[AttentionBackend],
        rope_interleaved: bool,
        prefix: str = "",
        kv_cache_dtype: str = "auto",
        bias: bool = False,
    ) -> None:
        super().__init__()
        for role, backend in (("decode", decode_backend), ("prefill", prefill_backend)):
            phases = getattr(backend, "mla_phases", ())
            if not backend.is_mla or role not in phases:
                raise ValueError(f"{prefix}: the MLA {role} backend {backend.NAME} does not implement MLA {role}")
        self.dims = dims
        self.prefix = prefix
        h = dims.num_heads
        self.num_heads = h
        self.num_kv_heads = 1
        self.head_size = dims.latent_size
        self.scale = scale
        self.rope_interleaved = rope_interleaved
        self.q_lora_rank = q_lora_rank

        def join(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, h * dims.qk_head_dim, bias=False, prefix=join("q_proj"))
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias, prefix=join("q_a_proj"))
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps)
            self.q_b_proj = Linear(q_lora_rank, h * dims.qk_head_dim, bias=False, prefix=join("q_b_proj"))
        self.kv_a_proj_with_mqa = Linear(hidden_size, dims.latent_size, bias=bias, prefix=join("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, eps=rms_norm_eps)
        self.kv_b_proj = Linear(
            dims.kv_lora_rank, h * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False, prefix=join("kv_b_proj")
        )
        self.o_proj = Linear(h * dims.v_head_dim, hidden_size, bias=bias, prefix=join("o_proj"))

        self.backend = decode_backend
        self.prefill_backend = prefill_backend
        # One impl per layer and backend: a backend serving both phases shares it.
        self.decode_impl = _make_impl(decode_backend, dims, scale, kv_cache_dtype)
        if prefill_backend is decode_backend:
            self.prefill_impl = self.decode_impl
        else:
            self.prefill_impl = _make_impl(prefill_backend, dims, scale, kv_cache_dtype)
        # Bound by the model runner after the KV cache is allocated.
        self.kv_cache: torch.Tensor = torch.empty(0)

    # ------------------------------------------------------------------ weights
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, qk_nope, L], W_UV [H, v, L])``: views of ``kv_b_proj.weight``
        (``[H * (qk_nope + v), L]``), so they always follow the loaded weights (of a
        quantized ``kv_b_proj``, its dequantized weight)."""
        d = self.dims
        w = self.kv_b_proj.dequantized_weight().view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    # ------------------------------------------------------------------ forward
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return RotaryEmbedding.rotate_heads(x, cos, sin)

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        d = self.dims
        n = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(n, d.num_heads, d.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        cos, sin = cos_sin
        q_nope = q[..., : d.qk_nope_head_dim]
        q_pe = self._rope(q[..., d.qk_nope_head_dim :], cos, sin)
        k_pe = self._rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)

        md: MLAMetadata = get_forward_context().attn_metadata
        self.decode_impl.write_latent(kv_c_normed, k_pe, self.kv_cache, md.slot_mapping)
        out = hidden_states.new_zeros(n, d.num_heads, d.v_head_dim)
        if md.decode is not None:
            self._decode(md.decode, q_nope, q_pe, out)
        if md.prefill is not None:
            self._prefill(md.prefill, q_nope, q_pe, kv_c_normed, k_pe, out)
        return self.o_proj(out.view(n, d.num_heads * d.v_head_dim))

    def _decode(self, batch: MLAPhaseBatch, q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor) -> None:
        d = self.dims
        w_uk, w_uv = self.absorbed_weights()
        qn, qp = batch.select(q_nope), batch.select(q_pe)  # [B, H, nope], [B, H, R]
        b = qn.shape[0]
        # Absorb W_UK: per head, q_nope [B, nope] @ W_UK [nope, L] -> [B, L].
        ql_nope = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1)
        q_lat = torch.cat((ql_nope, qp), dim=-1)
        out_lat = q_lat.new_empty(b, d.num_heads, d.kv_lora_rank)
        self.decode_impl.forward_decode(q_lat, self.kv_cache, batch.backend_metadata, out_lat)
        # W_UV after attention: per head, out_lat [B, L] @ W_UV^T [L, v] -> [B, v].
        o = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        batch.scatter(out, o)

    def _prefill(
        self,
        batch: MLAPrefillBatch,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        d = self.dims
        q = torch.cat((batch.select(q_nope), batch.select(q_pe)), dim=-1)  # [Nq, H, nope + R]
        if batch.context_slots is None:
            kv_c_seq, k_pe_seq = batch.select(kv_c_normed), batch.select(k_pe)
        else:
            # The whole sequences, cached prefix included, read back from the latent cache
            # (this step's rows were written above).
            rows = self.kv_cache.view(-1, d.latent_size).index_select(0, batch.context_slots)
            kv_c_seq, k_pe_seq = rows[:, : d.kv_lora_rank], rows[:, d.kv_lora_rank :]
            kv_c_seq, k_pe_seq = kv_c_seq.to(q.dtype), k_pe_seq.to(q.dtype)
        nk = kv_c_seq.shape[0]
        kv = self.kv_b_proj(kv_c_seq.contiguous()).view(nk, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe_seq.unsqueeze(1).expand(nk, d.num_heads, d.qk_rope_head_dim)), dim=-1)
        o = q.new_empty(q.shape[0], d.num_heads, d.v_head_dim)
        self.prefill_impl.forward_prefill(q, k, v.contiguous(), batch.backend_metadata, o)
        batch.scatter(out, o)

    def extra_repr(self) -> str:
        return (
            f"dims={self.dims}, q_lora_rank={self.q_lora_rank}, decode={self.backend.NAME}, "
            f"prefill={self.prefill_backend.NAME}"
        )
