"""The attention call as a torch custom op: ``torch.ops.kvloom.unified_attention``.

Under ``torch.compile`` the ``Attention`` layer calls this op instead of its backend, so
Dynamo records one opaque node per layer and never traces into a backend (Triton
launches, FlashInfer wrappers, host-side metadata). The node is where the compilation
backend splits the graph (``kvloom.compilation.backend``). The op finds its layer by name
in the forward context (``ForwardContext.attn_layers``), as the layer object cannot be an
op argument; it writes into ``output``, which the graph allocates before the call, so
under piecewise CUDA graphs the buffer belongs to the preceding piece's graph and keeps
its address from one replay to the next.

The op runs eagerly between two pieces on every layer of every step, so its dispatch is
host time on the step's critical path. It is defined with ``torch.library.Library``
directly: ``torch.library.custom_op`` would wrap every call in its Python dispatch layer
(a Dynamo-disable context and aliasing checks), ~4 us per call more on the CPU
(``benchmarks/bench_piecewise_cpu.py``).
"""

from __future__ import annotations

import torch

from kvloom.forward_context import get_forward_context

#: The op's qualified name, the default entry of ``CompilationConfig.splitting_ops``.
UNIFIED_ATTENTION = "kvloom::unified_attention"

# Kept at module level: a Library deregisters its definitions when it is collected.
_lib = torch.library.Library("kvloom", "FRAGMENT")
_lib.define("unified_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, str layer_name) -> ()")


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


def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


# One kernel for every device (CPU, CUDA, ...): the backend behind it picks the device code.
_lib.impl("unified_attention", unified_attention, "CompositeExplicitAutograd")
torch.library.register_fake(UNIFIED_ATTENTION, _fake, lib=_lib)
