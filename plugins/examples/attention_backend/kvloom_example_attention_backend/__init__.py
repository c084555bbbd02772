"""EXAMPLE_ATTN: paged attention in plain torch, written to be read and copied.

The three parts of a backend: ``ExampleAttentionBackend`` declares what it supports and
names the other two; ``ExampleMetadataBuilder`` prepares each step once for all layers;
``ExampleAttentionImpl.forward`` writes the step's keys and values into the paged cache and
attends. It runs on the CPU and on CUDA (slowly: one request at a time, in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.0"


@dataclass
class ExampleAttentionMetadata:
    """One step, as the impl reads it (built once, shared by every layer)."""

    num_actual_tokens: int  # tokens before CUDA-graph padding
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]; -1 = do not write
    causal: bool
    #: Per request: (first token row, end token row, seq_len, block ids of the sequence).
    requests: list[tuple[int, int, int, torch.Tensor]]


class ExampleMetadataBuilder(AttentionMetadataBuilder[ExampleAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> ExampleAttentionMetadata:
        # Host copies (``*_cpu``) tell the layout without a device sync.
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        block_size = self.spec.block_size
        requests = []
        for i in range(common.num_reqs):
            num_blocks = -(-seq_lens[i] // block_size)
            blocks = common.block_table[i, :num_blocks].long()
            requests.append((starts[i], starts[i + 1], seq_lens[i], blocks))
        return ExampleAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            causal=common.causal,
            requests=requests,
        )


class ExampleAttentionImpl(AttentionImpl[ExampleAttentionMetadata]):
    def forward(
        self,
        query: torch.Tensor,  # [N, num_heads, head_size], may be a strided view
        key: torch.Tensor,  # [N, num_kv_heads, head_size]
        value: torch.Tensor,  # [N, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...), bound to this layer
        attn_metadata: ExampleAttentionMetadata,
        output: torch.Tensor,  # [N, num_heads, head_size]: write the result here
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = ExampleAttentionBackend.split_kv_cache(kv_cache)
        block_size = key_cache.shape[1]

        # 1. Write the new keys and values to their slots; -1 (padding) is skipped.
        n = md.num_actual_tokens
        slots = md.slot_mapping
        keep = slots >= 0
        blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
        key_cache[blocks, offsets] = key[:n][keep].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[:n][keep].to(value_cache.dtype)

        # 2. Attend, request by request, over the cached context and the new tokens.
        for start, end, seq_len, block_ids in md.requests:
            query_len = end - start
            k = key_cache[block_ids].flatten(0, 1)[:seq_len].float()  # [seq_len, kv_heads, D]
            v = value_cache[block_ids].flatten(0, 1)[:seq_len].float()
            k = k.repeat_interleave(self.queries_per_kv, dim=1)  # GQA: one KV head per query group
            v = v.repeat_interleave(self.queries_per_kv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * self.scale
            if md.causal:  # new token j sits at position seq_len - query_len + j
                q_pos = torch.arange(seq_len - query_len, seq_len, device=k.device)[:, None]
                k_pos = torch.arange(seq_len, device=k.device)[None, :]
                scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
            output[start:end] = out.to(output.dtype)
        return output


class ExampleAttentionBackend(AttentionBackend):
    NAME = "EXAMPLE_ATTN"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = (MultipleOf(8),)  # the engine then picks 16
    supported_head_sizes = (16, 32, 64, 128)
    supported_device_types = ("cpu", "cuda")
    cudagraph_support = AttentionCGSupport.NEVER  # forward syncs with the host

    @staticmethod
    def get_impl_cls() -> type[ExampleAttentionImpl]:
        return ExampleAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ExampleMetadataBuilder]:
        return ExampleMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)  # split_kv_cache's default layout

    @classmethod
    def extra_validation(cls, config: AttentionSelectorConfig) -> list[str]:
        # A rule the declarations cannot express; return reasons, never raise.
        if config.num_heads and config.num_kv_heads and config.num_heads % config.num_kv_heads:
            return [f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"]
        return []
