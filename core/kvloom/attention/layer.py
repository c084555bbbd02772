"""The logical attention layer: what every model uses, whatever the backend."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.attention.backend import AttentionBackend, AttentionType
import kvloom.compilation.attention_op  # noqa: F401  (registers torch.ops.kvloom.unified_attention)
from kvloom.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over the KV cache, delegated to the selected backend's impl.

    Takes ``q [N, num_heads*head_size]``, ``k``/``v [N, num_kv_heads*head_size]`` and
    returns ``[N, num_heads*head_size]``. The model runner binds ``kv_cache`` once the
    cache is allocated.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        backend: type[AttentionBackend],
        prefix: str = "",
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{prefix}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.backend = backend
        self.impl = backend.get_impl_cls()(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=kv_cache_dtype,
            attn_type=attn_type,
            sliding_window=sliding_window,
        )
        # Bound by the model runner after the KV cache is allocated.
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        query = q.view(n, self.num_heads, self.head_size)
        key = k.view(n, self.num_kv_heads, self.head_size)
        value = v.view(n, self.num_kv_heads, self.head_size)
        output = torch.empty_like(query)
        if torch.compiler.is_compiling():
            # One opaque node in the compiled graph (the split point); see
            # kvloom.compilation.attention_op. ``prefix`` names the layer there.
            torch.ops.kvloom.unified_attention(query, key, value, output, self.prefix)
        else:
            self.run_backend(query, key, value, output)
        return output.view(n, self.num_heads * self.head_size)

    def run_backend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        """The backend's attention into ``output``. Rows past the forward context's
        ``num_actual_tokens`` are padding (a piecewise CUDA graph's capture size): the
        backend sees only the real rows, and the padding rows of ``output`` stay as they are.
        With a KV connector, its loads into this layer are waited for first and its saves
        of the layer started after."""
        ctx = get_forward_context()
        n = ctx.num_actual_tokens
        if n is not None and n < query.shape[0]:
            query, key, value, output = query[:n], key[:n], value[:n], output[:n]
        transfer = ctx.kv_connector  # the KV connector's loads into this layer first, its saves after
        if transfer is not None:
            transfer.wait_for_layer_load(self.prefix)
        self.impl.forward(query, key, value, self.kv_cache, ctx.attn_metadata, output)
        if transfer is not None:
            transfer.save_kv_layer(self.prefix, self.kv_cache, ctx.attn_metadata)
