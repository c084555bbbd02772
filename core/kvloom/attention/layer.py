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

    ``sliding_window``, ``logits_soft_cap`` and ``sinks`` (a float32 ``[num_heads]``
    parameter of the model's attention block, filled when the weights load) are the
    backend contract's attention features (``kvloom.attention.backend``). In a model with
    several KV-cache groups the runner sets ``kv_cache_group_id``: the layer then reads
    its group's entry of the step's metadata (a list, one per group).
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
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
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
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.impl = backend.get_impl_cls()(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=kv_cache_dtype,
            attn_type=attn_type,
            sliding_window=sliding_window,
            # Passed only when set: impls written before plugin API 1.1 take neither.
            **({"logits_soft_cap": logits_soft_cap} if logits_soft_cap is not None else {}),
            **({"sinks": sinks} if sinks is not None else {}),
        )
        # Bound by the model runner after the KV cache is allocated.
        self.kv_cache: torch.Tensor = torch.empty(0)
        #: This layer's KV-cache group when the model has several (set by the runner).
        self.kv_cache_group_id: int | None = None
        #: Which of the fp8 KV cache's scales the checkpoint gave (the rest stay 1.0).
        self.kv_scales_loaded: set[str] = set()

    def load_kv_scale(self, name: str, loaded: torch.Tensor) -> None:
        """Load a checkpoint's per-tensor fp8 KV-cache scale: ``name`` ``"k_scale"``,
        ``"v_scale"`` or ``"kv_scale"`` (both), a one-element tensor; the impl reads it
        (``AttentionImpl.k_scale`` / ``v_scale``). A scale that is not a positive finite
        number is an error naming the layer."""
        if loaded.numel() != 1:
            raise ValueError(f"{self.prefix}.{name}: a KV-cache scale is one value, got shape {tuple(loaded.shape)}")
        value = float(loaded.reshape(()).float())
        if not value > 0.0 or value == float("inf"):
            raise ValueError(f"{self.prefix}.{name}: a KV-cache scale must be positive and finite, got {value}")
        for which in ("k", "v") if name == "kv_scale" else (name[0],):
            setattr(self.impl, f"{which}_scale", value)
            self.kv_scales_loaded.add(f"{which}_scale")

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
        metadata = ctx.attn_metadata if self.kv_cache_group_id is None else ctx.attn_metadata[self.kv_cache_group_id]
        transfer = ctx.kv_connector  # the KV connector's loads into this layer first, its saves after
        if transfer is not None:
            transfer.wait_for_layer_load(self.prefix)
        self.impl.forward(query, key, value, self.kv_cache, metadata, output)
        if transfer is not None:
            transfer.save_kv_layer(self.prefix, self.kv_cache, metadata)
