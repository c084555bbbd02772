"""An obviously-correct paged attention backend for tests (not a plugin).

Plain torch, one request at a time, float32 math: write K/V through the slot mapping,
then for each request gather its whole sequence from the block table and run causal
softmax attention. Slow and simple on purpose: model tests use it as the attention
reference while the real backends are tested against the conformance suite.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)


class ReferenceMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class ReferenceAttentionImpl(AttentionImpl[CommonAttentionMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CommonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = ReferenceBackend.split_kv_cache(kv_cache)
        block_size = key_cache.shape[1]
        n = md.num_actual_tokens
        slots = md.slot_mapping[:n]
        write = slots >= 0
        blocks, offsets = slots[write] // block_size, slots[write] % block_size
        key_cache[blocks, offsets] = key[:n][write].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[:n][write].to(value_cache.dtype)

        group = self.num_heads // self.num_kv_heads
        qsl = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens_cpu.tolist()
        for i in range(md.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            q_len = end - start
            if q_len == 0:
                continue
            positions = torch.arange(seq_len, device=query.device)
            block_ids = md.block_table[i, positions // block_size].long()
            k = key_cache[block_ids, positions % block_size].float()  # [S, Hk, D]
            v = value_cache[block_ids, positions % block_size].float()
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            q = query[start:end].float()  # [Q, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = positions[None, :] > q_pos[:, None]  # future keys
            scores = scores.masked_fill(mask[None], float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
            output[start:end] = out.to(output.dtype)
        return output


class ReferenceBackend(AttentionBackend):
    NAME: ClassVar[str] = "TEST_REFERENCE"
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_block_sizes = (MultipleOf(1),)
    supported_device_types = ("cpu", "cuda")

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return ReferenceAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return ReferenceMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
