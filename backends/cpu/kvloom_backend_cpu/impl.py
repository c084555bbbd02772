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

fp8 KV cache: the write stores ``quantize_kv(k, k_scale)`` (torch has no fp8 copies on the
CPU, so the cache is moved as bytes), the reads upcast the gathered rows
(``dequantize_kv``), and a prefill without context attends to its own keys and values
as the cache holds them (quantized and back), like every later read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.interfaces import AttentionImpl, dequantize_kv, is_fp8_kv_cache, quantize_kv
from kvloom_backend_cpu.builder import CPUAttentionMetadata, DecodeBatch, PrefillRequest


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as raw bytes (torch's CPU index ops do not take fp8), others as they are."""
    return t.view(torch.uint8) if is_fp8_kv_cache(t) else t


class CPUAttentionImpl(AttentionImpl[CPUAttentionMetadata]):
    impl_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

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
        new_keys = _bytes(quantize_kv(new_keys, self.k_scale, key_cache.dtype))
        new_values = _bytes(quantize_kv(new_values, self.v_scale, value_cache.dtype))
        _bytes(key_cache).view(flat_shape).index_copy_(0, md.write_slots, new_keys)
        _bytes(value_cache).view(flat_shape).index_copy_(0, md.write_slots, new_values)

    def _gather_blocks(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_ids: torch.Tensor,
        md: CPUAttentionMetadata,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given blocks, ``[len(block_ids), block_size, Hkv, D]`` each (an fp8
        cache's upcast to the model dtype)."""
        shape = (2, block_ids.numel(), *key_cache.shape[1:])
        buffer = md.workspace.get(shape, _bytes(key_cache).dtype)
        torch.index_select(_bytes(key_cache), 0, block_ids, out=buffer[0])
        torch.index_select(_bytes(value_cache), 0, block_ids, out=buffer[1])
        return self._upcast(buffer[0], key_cache, self.k_scale, dtype), self._upcast(buffer[1], value_cache,
                                                                                     self.v_scale, dtype)

    @staticmethod
    def _upcast(rows: torch.Tensor, cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Rows gathered from ``cache`` (as bytes when it is fp8) in the model dtype ``dtype``."""
        if not is_fp8_kv_cache(cache):
            return rows
        return dequantize_kv(rows.view(cache.dtype), scale, dtype)

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
        buffer = md.workspace.get((2, num * kv_heads * length, self.head_size), _bytes(key_cache).dtype)
        torch.index_select(_bytes(key_cache).view(-1, self.head_size), 0, batch.kv_rows, out=buffer[0])
        torch.index_select(_bytes(value_cache).view(-1, self.head_size), 0, batch.kv_rows, out=buffer[1])
        keys = self._upcast(buffer[0], key_cache, self.k_scale, query.dtype)
        values = self._upcast(buffer[1], value_cache, self.v_scale, query.dtype)
        if batch.pad_rows.numel():
            # Slots never written (the cache is allocated uninitialised) may hold NaN.
            keys.index_fill_(0, batch.pad_rows, 0.0)
            values.index_fill_(0, batch.pad_rows, 0.0)
        keys = keys.view(num, kv_heads, length, self.head_size)
        values = values.view(num, kv_heads, length, self.head_size)
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

    def _as_cached(self, x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The step's own keys or values as the cache holds them (quantized and back for fp8)."""
        if not is_fp8_kv_cache(cache):
            return x
        return dequantize_kv(quantize_kv(x, scale, cache.dtype), scale, x.dtype)

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
            k = self._as_cached(key[start:end], key_cache, self.k_scale).transpose(0, 1).unsqueeze(0)
            v = self._as_cached(value[start:end], value_cache, self.v_scale).transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            keys, values = self._gather_blocks(key_cache, value_cache, request.block_ids, md, query.dtype)
            k = keys.view(-1, self.num_kv_heads, self.head_size)[: request.seq_len].transpose(0, 1).unsqueeze(0)
            v = values.view(-1, self.num_kv_heads, self.head_size)[: request.seq_len].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=request.mask, scale=self.scale, enable_gqa=gqa
            )
        output[start:end] = out[0].transpose(0, 1)
