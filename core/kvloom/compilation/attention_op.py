"""The attention call as a torch custom op: ``torch.ops.kvloom.unified_attention``.

Under ``torch.compile`` the ``Attention`` layer calls this op instead of its backend, so
Dynamo records one opaque node per layer and never traces into a backend (Triton
launches, FlashInfer wrappers, host-side metadata). The node is where the compilation
backend splits the graph (``kvloom.compilation.backend``). The op finds its layer by name
in the forward context (``ForwardContext.attn_layers``), as the layer object cannot be an
op argument; it writes into ``output``, which the graph allocates before the call, so
under piecewise CUDA graphs the buffer belongs to the preceding piece's graph and keeps
its address from one replay to the next.
"""

from __future__ import annotations

import torch

from kvloom.forward_context import get_forward_context

#: The op's qualified name, the default entry of ``CompilationConfig.splitting_ops``.
UNIFIED_ATTENTION = "kvloom::unified_attention"


@torch.library.custom_op(UNIFIED_ATTENTION, mutates_args=("output",))
def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    layers = get_forward_context().attn_layers
    if layers is None or layer_name not in layers:
        raise RuntimeError(
            f"kvloom::unified_attention: layer {layer_name!r} is not in the forward context's attn_layers "
            "(the model runner passes them to set_forward_context when the model is compiled)"
        )
    layers[layer_name].run_backend(query, key, value, output)


@unified_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None
