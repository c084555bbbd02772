"""The FLEX_ATTENTION impl: write K/V through the slot mapping, then one compiled
``flex_attention`` call per query group over the whole paged cache.

``flex_attention`` must run compiled: uncompiled it is a reference implementation that
materialises the full ``[rows, num_blocks * block_size]`` score matrix. One compiled
function serves every layer and step. Shapes are left to dynamo's automatic dynamism
(the first call of a variant compiles static shapes, the first shape change recompiles
with dynamic ones): on the CPU's inductor template, ``dynamic=True`` from the start
produced C++ that failed to compile. Variants: one per query block size (two), dtype,
head size and cache block size.

Attention sinks (gpt-oss: a learned logit ``s_h`` per head in the softmax's denominator)
rescale flex's output with the log-sum-exp it returns: with ``L`` the log-sum-exp of a
row's scores, ``softmax`` over the scores and the sink gives the output times
``e^L / (e^L + e^s_h) = sigmoid(L - s_h)``, exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from kvloom.interfaces import AttentionImpl, write_kv_default_layout
from kvloom_backend_flex_attention.metadata import FlexAttentionMetadata

#: Each kernel variant costs dynamo up to two cache entries of flex_attention's frame;
#: past torch's default limit of 8 it would silently run the uncompiled reference.
_MIN_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_flex_attention() -> Callable:
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _MIN_RECOMPILE_LIMIT)
    return torch.compile(flex_attention, fullgraph=True)


def cuda_kernel_options(q_block_size: int, block_size: int, head_size: int, dtype: torch.dtype) -> dict:
    """Triton tile sizes for flex's CUDA kernel.

    Flex requires ``Q_BLOCK % BLOCK_M == 0`` and ``KV_BLOCK % BLOCK_N == 0`` (and fails
    rather than adapt when its default tile does not divide); the KV blocks here are cache
    pages, so ``BLOCK_N`` divides the page size. Rows of K/V per tile shrink as heads widen
    to keep Q plus three pipelined K/V stages well inside shared memory (~128-160 KiB).
    """
    row_bytes = head_size * dtype.itemsize
    max_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    options = {
        "BLOCK_M": q_block_size,
        "BLOCK_N": math.gcd(block_size, max_n),
        # Always the main kernel: the decoding kernel picks its own query tiles.
        "FORCE_USE_FLEX_ATTENTION": True,
    }
    if q_block_size <= 32:
        options["num_warps"] = 4  # flex's defaults (up to 8 warps) assume 64-128-row tiles
    return options


def soft_cap_score_mod(cap: float) -> Callable:
    """``score_mod``: Gemma 2's logit soft cap, ``cap * tanh(score / cap)`` of the scaled score."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


class FlexAttentionImpl(AttentionImpl[FlexAttentionMetadata]):
    # The window is in the step's mask (planned per KV-cache group), the cap a score_mod,
    # the sinks a rescaling by the returned log-sum-exp (module docstring).
    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True
    impl_supports_sinks = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The flex function; tests may swap in the uncompiled reference.
        self.flex_fn: Callable = compiled_flex_attention()
        self.score_mod = None if self.logits_soft_cap is None else soft_cap_score_mod(self.logits_soft_cap)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlexAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata.sliding_window != self.sliding_window:
            raise ValueError(
                f"layer sliding_window {self.sliding_window} differs from the step's plan "
                f"({attn_metadata.sliding_window}); FLEX_ATTENTION plans one window for a KV-cache group's layers"
            )
        write_kv_default_layout(kv_cache, key, value, attn_metadata.slot_mapping)

        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        kv_len = num_blocks * block_size
        # [1, kv_heads, kv_len, dim] views of the whole cache, slots in physical order.
        k = kv_cache[0].view(1, kv_len, num_kv_heads, head_size).transpose(1, 2)
        v = kv_cache[1].view(1, kv_len, num_kv_heads, head_size).transpose(1, 2)
        on_cuda = query.device.type == "cuda"
        for group, block_mask in zip(attn_metadata.groups, attn_metadata.block_masks(num_blocks)):
            q_rows = query.new_zeros(group.num_rows, self.num_heads, self.head_size)
            q_rows.index_copy_(0, group.row_of_token, query.index_select(0, group.token_index))
            out = self.flex_fn(
                q_rows.unsqueeze(0).transpose(1, 2),
                k,
                v,
                score_mod=self.score_mod,
                block_mask=block_mask,
                scale=self.scale,
                enable_gqa=self.num_heads != num_kv_heads,
                kernel_options=cuda_kernel_options(group.q_block_size, block_size, head_size, query.dtype)
                if on_cuda
                else None,
                return_aux=None if self.sinks is None else AuxRequest(lse=True),
            )
            if self.sinks is not None:
                out, aux = out  # out [1, heads, rows, dim], aux.lse [1, heads, rows] (float32)
                keep = torch.sigmoid(aux.lse - self.sinks.to(aux.lse.dtype)[None, :, None])
                out = (out.float() * keep.unsqueeze(-1)).to(out.dtype)
            out_rows = out.transpose(1, 2)[0]  # [rows, heads, dim]
            output.index_copy_(0, group.token_index, out_rows.index_select(0, group.row_of_token).to(output.dtype))
        return output
