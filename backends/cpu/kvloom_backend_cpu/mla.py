"""CPU_MLA: multi-head latent attention on the CPU in plain torch (both phases).

The reference MLA backend of CI. The core (``kvloom.attention.mla_layer``) does the MLA math
common to every backend; this module supplies the two kernels of the contract:

- decode: for each decode request, its latent rows are gathered from the paged cache
  into a padded ``[B, T, L + R]`` tensor (T = the longest sequence), and one
  ``scaled_dot_product_attention`` call treats the ``H`` query heads as ``H`` query rows
  of the single latent KV head (keys = the whole row, values = its first ``L`` values);
  a key mask hides the padding.
- prefill: one SDPA call per request over the decompressed per-head K/V, with a causal
  mask shifted by the request's cached context (bottom-right aligned).

The latent cache keeps the contract's layout ``(num_blocks, block_size, L + R)``, written
by the core's torch default (``MLAAttentionImpl.write_latent``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.interfaces import (
    MLA_DECODE,
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionBackend,
    MLAAttentionImpl,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.0"


@dataclass
class CPUMLADecodePlan:
    """The decode requests' cache rows, planned once per step for all layers."""

    #: int64 ``[B, T]``: the flat cache row (slot) of position ``t`` of request ``b``;
    #: positions past ``seq_lens[b]`` read slot 0 and are masked out.
    slots: torch.Tensor
    #: bool ``[B, 1, 1, T]``: True = a real key position.
    key_mask: torch.Tensor


@dataclass
class CPUMLAPrefillRequest:
    """One prefill request's rows in the phase's ``q`` and ``k``/``v``."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    #: bool ``[query_len, seq_len]``, the causal mask shifted by the context; ``None``
    #: without context (plain ``is_causal``).
    mask: torch.Tensor | None


@dataclass
class CPUMLAMetadata:
    decode: CPUMLADecodePlan | None
    prefills: list[CPUMLAPrefillRequest]


class CPUMLAMetadataBuilder(AttentionMetadataBuilder[CPUMLAMetadata]):
    """Plans one phase's requests (the core builds one builder per phase)."""

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.phase = spec.extra.get("mla_phase", MLA_DECODE)

    def build(self, common: CommonAttentionMetadata) -> CPUMLAMetadata:
        if self.phase == MLA_DECODE:
            return CPUMLAMetadata(self._plan_decode(common), [])
        return CPUMLAMetadata(None, self._plan_prefill(common))

    def _plan_decode(self, common: CommonAttentionMetadata) -> CPUMLADecodePlan:
        b = common.num_reqs
        bs = self.spec.block_size
        t = max(int(common.max_seq_len), 1)
        pos = torch.arange(t, device=self.device)
        seq_lens = common.seq_lens[:b].to(torch.int64)
        valid = pos[None, :] < seq_lens[:, None]
        block_idx = torch.where(valid, pos[None, :] // bs, torch.zeros_like(pos)[None, :])
        blocks = torch.gather(common.block_table[:b].to(torch.int64), 1, block_idx)
        slots = torch.where(valid, blocks * bs + pos[None, :] % bs, torch.zeros_like(blocks))
        return CPUMLADecodePlan(slots=slots, key_mask=valid.view(b, 1, 1, t))

    def _plan_prefill(self, common: CommonAttentionMetadata) -> list[CPUMLAPrefillRequest]:
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        requests, k_start = [], 0
        for i in range(common.num_reqs):
            q_len, seq_len = qsl[i + 1] - qsl[i], int(seq_lens[i])
            context = seq_len - q_len
            mask = None
            if context > 0:
                q_pos = torch.arange(q_len, device=self.device)[:, None] + context
                mask = torch.arange(seq_len, device=self.device)[None, :] <= q_pos
            requests.append(CPUMLAPrefillRequest(qsl[i], qsl[i + 1], k_start, k_start + seq_len, mask))
            k_start += seq_len
        return requests


class CPUMLAImpl(MLAAttentionImpl):
    """Both MLA kernels in torch (see the module docstring)."""

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: CPUMLAMetadata, out: torch.Tensor
    ) -> torch.Tensor:
        plan = attn_metadata.decode
        if plan is None:
            raise ValueError("CPU_MLA: forward_decode got metadata planned for prefill")
        b = plan.slots.shape[0]
        rows = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, plan.slots.view(-1))
        keys = rows.view(b, 1, -1, kv_cache.shape[-1]).to(q.dtype)  # [B, 1, T, L + R]
        values = keys[..., : self.kv_lora_rank]  # [B, 1, T, L]
        # The H query heads are the query rows of the one latent KV head.
        attn = F.scaled_dot_product_attention(
            q[:b].unsqueeze(1), keys, values, attn_mask=plan.key_mask, scale=self.scale
        )
        out[:b] = attn.squeeze(1)
        return out

    def forward_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: CPUMLAMetadata, out: torch.Tensor
    ) -> torch.Tensor:
        for r in attn_metadata.prefills:
            qi = q[r.q_start : r.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k[r.k_start : r.k_end].transpose(0, 1).unsqueeze(0)
            vi = v[r.k_start : r.k_end].transpose(0, 1).unsqueeze(0)
            if r.mask is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
            else:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=r.mask, scale=self.scale)
            out[r.q_start : r.q_end] = o[0].transpose(0, 1)
        return out


class CPUMLABackend(MLAAttentionBackend):
    """MLA for the CPU in plain torch: decode and prefill, any block size."""

    NAME = "CPU_MLA"
    mla_phases = ("decode", "prefill")
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = (MultipleOf(1),)
    supported_device_types = ("cpu",)
    supported_attn_types = (AttentionType.DECODER,)
    cudagraph_support = AttentionCGSupport.NEVER

    @staticmethod
    def get_impl_cls() -> type[CPUMLAImpl]:  # type: ignore[override]
        return CPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[CPUMLAMetadataBuilder]:
        return CPUMLAMetadataBuilder
