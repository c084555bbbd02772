"""The per-layer attention implementation of CPU_ATTN.

- KV write: the C kernel (``kernels``) for a float32 cache, else ``index_copy_`` of the
  step's keys/values to the slots the builder kept.
- Decode requests of float32 layers without soft cap or sinks run through the C kernel
  of ``kernels`` (each request's keys and values read in place from its blocks);
  the others run as one batch per length group: their K/V rows are gathered into
  the workspace and a single ``scaled_dot_product_attention`` call treats the
  ``num_heads // num_kv_heads`` query heads that share a KV head as that KV head's
  "query rows" (no K/V replication for GQA/MQA).
- Prefill requests run one SDPA call each: without context on the step's own keys/values
  with ``is_causal``; with context over the request's blocks gathered from the cache with
  the builder's shifted causal mask.
- Sliding windows: the builder gathers from each request's window and its masks hide the
  positions before each query's window.
- Logit soft-capping and attention sinks, which SDPA cannot express, run the same
  shapes through ``attend_explicit``: scores in float32, ``cap * tanh(s / cap)``, the mask,
  one more softmax column holding the head's sink logit (dropped after the softmax).

fp8 KV cache: the write stores ``quantize_kv(k, k_scale)`` (torch has no fp8 copies on the
CPU, so the cache is moved as bytes), the reads upcast the gathered rows
(``dequantize_kv``), and a prefill without context attends to its own keys and values
as the cache holds them (quantized and back), like every later read.

torch's CPU SDPA kernel computes in the input dtype and accumulates the softmax and the
products in fp32 for fp16/bf16 inputs, which is what we want for half dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvloom.interfaces import AttentionImpl, dequantize_kv, is_fp8_kv_cache, prepare_c_library, quantize_kv
from kvloom_backend_cpu import kernels
from kvloom_backend_cpu.builder import CPUAttentionMetadata, DecodeBatch, PrefillRequest


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as raw bytes (torch's CPU index ops do not take fp8), others as they are."""
    return t.view(torch.uint8) if is_fp8_kv_cache(t) else t


def attend_explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    sink_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with the scores written out: ``q [B, Hkv, M, D]`` (M query rows per KV
    head), ``k``/``v [B, Hkv, S, D]``, ``mask`` bool broadcastable to ``[B, Hkv, M, S]``,
    ``sink_rows`` float ``[Hkv, M]`` (each row's sink logit) or None. In float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    num_keys = scores.shape[-1]
    if sink_rows is not None:
        sink = sink_rows.float()[None, :, :, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(dim=-1)[..., :num_keys]
    return torch.matmul(probs, v.float()).to(q.dtype)


class CPUAttentionImpl(AttentionImpl[CPUAttentionMetadata]):
    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True
    impl_supports_sinks = True
    impl_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prepare_c_library(kernels.SOURCE)  # compiled while the model loads, not at the first decode

    def _explicit(self) -> bool:
        return self.logits_soft_cap is not None or self.sinks is not None

    def _kernel_layer(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> kernels.LayerArgs:
        """The decode kernel's struct of this layer and cache (made again if the cache moves)."""
        made = self.__dict__.get("_kernel_args")
        if made is None or made[0] != key_cache.data_ptr():
            made = (key_cache.data_ptr(), kernels.layer_args(self.num_heads, self.scale, key_cache, value_cache))
            self.__dict__["_kernel_args"] = made
        return made[1]

    def _kernel_decodes(self, query: torch.Tensor, key_cache: torch.Tensor, output: torch.Tensor) -> bool:
        """Whether the decode kernel attends this layer's decodes (float32, no soft cap or sinks)."""
        return (not self._explicit() and kernels.rows_contiguous(query) and kernels.rows_contiguous(output)
                and query.dtype == torch.float32 and self._kernel_covers(key_cache))  # fmt: skip

    def _kernel_covers(self, key_cache: torch.Tensor) -> bool:
        return kernels.covers(self.num_heads, self.num_kv_heads, self.head_size, key_cache)

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
        slots = md.write_slots
        if (md.write_rows is None and slots.dtype == torch.int64 and slots.is_contiguous()
                and kernels.rows_contiguous(key) and kernels.rows_contiguous(value) and key.dtype == torch.float32
                and value.dtype == torch.float32 and self._kernel_covers(key_cache)):  # fmt: skip
            kernels.write_kv(self._kernel_layer(key_cache, value_cache), slots, key, value)
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
        return (self._upcast(buffer[0], key_cache, self.k_scale, dtype),
                self._upcast(buffer[1], value_cache, self.v_scale, dtype))  # fmt: skip

    @staticmethod
    def _upcast(rows: torch.Tensor, cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Rows gathered from ``cache`` (as bytes when it is fp8) in the model dtype ``dtype``."""
        if not is_fp8_kv_cache(cache):
            return rows
        return dequantize_kv(rows.view(cache.dtype), scale, dtype)

    def _as_cached(self, x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The step's own keys or values as the cache holds them (quantized and back for fp8)."""
        if not is_fp8_kv_cache(cache):
            return x
        return dequantize_kv(quantize_kv(x, scale, cache.dtype), scale, x.dtype)

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
        if self._kernel_decodes(query, key_cache, output):
            kernels.decode_attention(self._kernel_layer(key_cache, value_cache), batch.kernel_args, query, output)
            return
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
        if self._explicit():
            sink_rows = None if self.sinks is None else self.sinks.view(kv_heads, self.queries_per_kv)
            out = attend_explicit(q, keys, values, batch.key_mask, self.scale, self.logits_soft_cap, sink_rows)
        else:
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
            k = self._as_cached(key[start:end], key_cache, self.k_scale).transpose(0, 1).unsqueeze(0)
            v = self._as_cached(value[start:end], value_cache, self.v_scale).transpose(0, 1).unsqueeze(0)
        else:
            keys, values = self._gather_blocks(key_cache, value_cache, request.block_ids, md, query.dtype)
            num_keys = request.seq_len - request.key_start
            k = keys.view(-1, self.num_kv_heads, self.head_size)[:num_keys].transpose(0, 1).unsqueeze(0)
            v = values.view(-1, self.num_kv_heads, self.head_size)[:num_keys].transpose(0, 1).unsqueeze(0)
        if self._explicit():
            out = self._prefill_explicit(q, k, v, request)
        elif request.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=request.mask, scale=self.scale, enable_gqa=gqa)
        output[start:end] = out[0].transpose(0, 1)

    def _prefill_explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: PrefillRequest
    ) -> torch.Tensor:
        """``attend_explicit`` for one prefill: the ``G`` query heads of a KV head and the
        ``n`` tokens become ``G * n`` rows of that head; returns ``[1, H, n, D]``."""
        n, group, kv_heads = q.shape[2], self.queries_per_kv, self.num_kv_heads
        mask = request.mask
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool).tril_()
        rows_q = q.reshape(1, kv_heads, group * n, self.head_size)
        rows_mask = mask[None].expand(group, *mask.shape).reshape(group * n, mask.shape[-1])
        sink_rows = None
        if self.sinks is not None:
            sink_rows = self.sinks.view(kv_heads, group, 1).expand(kv_heads, group, n).reshape(kv_heads, group * n)
        out = attend_explicit(rows_q, k, v, rows_mask, self.scale, self.logits_soft_cap, sink_rows)
        return out.view(1, self.num_heads, n, self.head_size)
