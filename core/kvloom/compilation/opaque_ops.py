"""The platform's layer kernels as opaque torch custom ops, for compiled models.

``Platform.custom_ops`` returns plain Python callables (Triton launches behind argument
checks). Dynamo would trace into them: host-side arithmetic on the symbolic token count,
kernel launch options, checks that raise. Under ``torch.compile`` the model loader
activates each of them through one ``torch.ops.kvloom_layer.<name>`` op instead, so the
graph records a single node per call whose output shape comes from a fake implementation,
and the kernel runs as given (inside the piecewise CUDA graphs like any other launch).

The ops dispatch to the callables activated for this process (one engine per process,
as ``kvloom.layers.custom_ops`` already assumes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

_impl: dict[str, Callable[..., object]] = {}


def _call(name: str, *args: object) -> object:
    fn = _impl.get(name)
    if fn is None:
        raise RuntimeError(f"torch.ops.kvloom_layer.{name}: no platform kernel is active for {name!r}")
    return fn(*args)


@torch.library.custom_op("kvloom_layer::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _call("rms_norm", x, weight, eps)  # type: ignore[return-value]


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("kvloom_layer::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _call("fused_add_rms_norm", x, residual, weight, eps)  # type: ignore[return-value]


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("kvloom_layer::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _call("silu_and_mul", x)  # type: ignore[return-value]


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


@torch.library.custom_op("kvloom_layer::rotary_qk", mutates_args=())
def rotary_qk(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _call("rotary_qk", x, cos, sin)  # type: ignore[return-value]


@rotary_qk.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("kvloom_layer::qk_norm_rotary", mutates_args=())
def qk_norm_rotary(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    return _call("qk_norm_rotary", x, q_weight, k_weight, num_q_heads, eps, cos, sin)  # type: ignore[return-value]


@qk_norm_rotary.register_fake
def _(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("kvloom_layer::fused_moe", mutates_args=())
def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    return _call("fused_moe", hidden, w13, w2, topk_weights, topk_ids)  # type: ignore[return-value]


@fused_moe.register_fake
def _(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    return torch.empty((hidden.shape[0], w2.shape[1]), dtype=hidden.dtype, device=hidden.device)


#: The ops a compiled model may call as opaque nodes (``lora_delta`` is absent: LoRA
#: models are not compiled).
OPAQUE_OPS: dict[str, Callable[..., object]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_qk": rotary_qk,
    "qk_norm_rotary": qk_norm_rotary,
    "fused_moe": fused_moe,
}


def as_opaque_ops(ops: Mapping[str, Callable[..., object]]) -> dict[str, Callable[..., object]]:
    """``ops`` as the callables a compiled model uses: each through its opaque torch op,
    which runs the given kernel. A name without an opaque op is an error (the model
    would trace into it)."""
    missing = sorted(set(ops) - set(OPAQUE_OPS))
    if missing:
        raise ValueError(f"custom op(s) {missing} cannot run in a compiled model (no opaque torch op); "
                         f"allowed under torch.compile: {sorted(OPAQUE_OPS)}")  # fmt: skip
    _impl.clear()
    _impl.update(ops)
    return {name: OPAQUE_OPS[name] for name in ops}
