"""OOT_TEST_ATTN: paged attention written plainly in torch, one request at a time.

Slow but exact enough to check against a float64 reference; it exists to show (and
test) that an attention backend from another distribution plugs into kvloom like a
first-party one. Its declared support is deliberately narrow (block sizes that are
multiples of 8, head sizes 32/64/128) so that validation has something to say.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.0"


class OotTestMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    """The impl reads the common metadata directly: nothing to precompute."""

    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class OotTestAttentionImpl(AttentionImpl[CommonAttentionMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CommonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        key_cache, value_cache = OotTestAttentionBackend.split_kv_cache(kv_cache)
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        n = attn_metadata.num_actual_tokens

        # 1. Write the new keys/values through the slot mapping (-1 = padding, skipped).
        slots = attn_metadata.slot_mapping[:n]
        keep = slots >= 0
        flat_keys = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        flat_values = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)
        flat_keys[slots[keep]] = key[:n][keep].to(key_cache.dtype)
        flat_values[slots[keep]] = value[:n][keep].to(value_cache.dtype)

        # 2. Attend, request by request, over the whole (cached + new) sequence.
        starts = attn_metadata.query_start_loc_cpu.tolist()
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        group = self.num_heads // self.num_kv_heads
        for i in range(attn_metadata.num_reqs):
            start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            query_len = end - start
            blocks = attn_metadata.block_table[i, : -(-seq_len // block_size)].long()
            k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
            v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            q = query[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if self.logits_soft_cap:
                scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            masked = torch.zeros(query_len, seq_len, dtype=torch.bool, device=q.device)
            if attn_metadata.causal:
                masked |= k_pos > q_pos
            if self.sliding_window is not None:
                masked |= k_pos <= q_pos - self.sliding_window
            scores = scores.masked_fill(masked, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
            output[start:end] = out.to(output.dtype)
        return output


class OotTestAttentionBackend(AttentionBackend):
    NAME = "OOT_TEST_ATTN"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = (MultipleOf(8),)
    supported_head_sizes = (32, 64, 128)
    supported_device_types = ("cpu", "cuda")
    cudagraph_support = AttentionCGSupport.NEVER

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return OotTestAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return OotTestMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
