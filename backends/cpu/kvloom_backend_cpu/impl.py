"""The per-layer attention implementation of CPU_ATTN.

- KV write: ``index_copy_`` of the step's keys/values to the slots the builder kept.
- Decode requests run as one batch per length group: their K/V rows are gathered into
  the workspace and a single ``scaled_dot_product_attention`` call treats the
  ``num_heads // num_kv_heads`` query heads that share a KV head as that KV head's
  "query rows" (no K/V replication for GQA/MQA).
- Prefill requests run one SDPA call each: without context on the step's own keys/values
  with ``is_causal``; with context over the request's blocks gathered from the cache with
  the builder's shifted causal mask.

torch's CPU SDPA kernel computes in the input dtype and accumulates the softmax and the
products in fp32 for fp16/bf16 inputs, which is what we want for half dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.interfaces import AttentionImpl
from kvloom_backend_cpu.builder import CPUAttentionMetadata, DecodeBatch, PrefillRequest


class CPUAttentionImpl(AttentionImpl[CPUAttentionMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._write_kv(key, value, key_cache, value_cache, md)
        for batch in md.decodes:
            self._decode(query, key_cache, value_cache, md, batch, output)
        for request in md.prefills:
            self._prefill(query, key, value, key_cache, value_cache, md, request, output)
        return output

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: CPUAttentionMetadata,
    ) -> None:
        count = md.write_slots.numel()
        if count == 0:
            return
        if md.write_rows is None:
            new_keys, new_values = key[:count], value[:count]
        else:
            new_keys, new_values = key.index_select(0, md.write_rows), value.index_select(0, md.write_rows)
        flat_shape = (-1, self.num_kv_heads, self.head_size)
        key_cache.view(flat_shape).index_copy_(0, md.write_slots, new_keys)
        value_cache.view(flat_shape).index_copy_(0, md.write_slots, new_values)

    def _gather_blocks(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_ids: torch.Tensor,
        md: CPUAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given blocks, ``[len(block_ids), block_size, Hkv, D]`` each."""
        shape = (2, block_ids.numel(), *key_cache.shape[1:])
        buffer = md.workspace.get(shape, key_cache.dtype)
        torch.index_select(key_cache, 0, block_ids, out=buffer[0])
        torch.index_select(value_cache, 0, block_ids, out=buffer[1])
        return buffer[0], buffer[1]

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: CPUAttentionMetadata,
        batch: DecodeBatch,
        output: torch.Tensor,
    ) -> None:
        num, kv_heads, length = batch.num_reqs, self.num_kv_heads, batch.padded_len
        if batch.num_kv_heads != kv_heads:
            raise ValueError(
                f"num_kv_heads: the metadata was planned for {batch.num_kv_heads} KV heads, this layer has {kv_heads}"
            )
        buffer = md.workspace.get((2, num * kv_heads * length, self.head_size), key_cache.dtype)
        torch.index_select(key_cache.view(-1, self.head_size), 0, batch.kv_rows, out=buffer[0])
        torch.index_select(value_cache.view(-1, self.head_size), 0, batch.kv_rows, out=buffer[1])
        if batch.pad_rows.numel():
            # Slots never written (the cache is allocated uninitialised) may hold NaN.
            buffer[0].index_fill_(0, batch.pad_rows, 0.0)
            buffer[1].index_fill_(0, batch.pad_rows, 0.0)
        keys = buffer[0].view(num, kv_heads, length, self.head_size)
        values = buffer[1].view(num, kv_heads, length, self.head_size)
        if batch.token_rows is None:
            q = query[batch.token_start : batch.token_start + num]
        else:
            q = query.index_select(0, batch.token_rows)
        # Query heads sharing a KV head become that head's rows: [B, Hkv, H/Hkv, D].
        q = q.unflatten(1, (kv_heads, self.queries_per_kv))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.key_mask, scale=self.scale)
        out = out.flatten(1, 2)
        if batch.token_rows is None:
            output[batch.token_start : batch.token_start + num] = out
        else:
            output.index_copy_(0, batch.token_rows, out)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: CPUAttentionMetadata,
        request: PrefillRequest,
        output: torch.Tensor,
    ) -> None:
        start, end = request.token_start, request.token_end
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        gqa = self.num_heads != self.num_kv_heads
        if request.block_ids is None:
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            keys, values = self._gather_blocks(key_cache, value_cache, request.block_ids, md)
            k = keys.view(-1, self.num_kv_heads, self.head_size)[: request.seq_len].transpose(0, 1).unsqueeze(0)
            v = values.view(-1, self.num_kv_heads, self.head_size)[: request.seq_len].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=request.mask, scale=self.scale, enable_gqa=gqa
            )
        output[start:end] = out[0].transpose(0, 1)
