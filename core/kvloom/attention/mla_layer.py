"""The multi-head latent attention (MLA, DeepSeek-V2/V3) layer that models build: every part
of MLA that is the same for all backends, done here once (as vLLM's ``MLACommonImpl``).

That is the query projection (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj`` when ``q_lora_rank`` is set), ``kv_a_proj_with_mqa`` -> ``c_kv`` + ``k_pe``,
``kv_a_layernorm``, RoPE on ``q_pe``/``k_pe``, the split of ``kv_b_proj`` into ``W_UK``
(``[H, qk_nope, L]``) and ``W_UV`` (``[H, v, L]``), the split of a step into decode and
prefill requests (``kvloom.attention.mla_metadata``), and ``o_proj``. The two phases
compute attention differently:

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

The latent cache layout and what a backend implements: ``kvloom.attention.mla_backend``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.attention.backend import AttentionBackend
from kvloom.attention.mla_backend import MLAAttentionImpl, MLADims
from kvloom.attention.mla_metadata import MLAMetadata, MLAPhaseBatch, MLAPrefillBatch
from kvloom.forward_context import get_forward_context
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.utils import join_prefix


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
            return join_prefix(prefix, name)

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
