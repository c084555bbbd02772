"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with gpt-oss's differences, as HF
transformers' ``modeling_gpt_oss.py`` computes them:

* attention with biases on q/k/v/o and learned attention sinks (one logit per head in
  every softmax's denominator; the backend must declare ``supports_sinks``), on
  alternating sliding-window (``sliding_window`` 128) and full-attention layers
  (``layer_types``): a hybrid KV cache of two groups;
* RoPE with YaRN scaling (``rope_parameters``, kvloom's ``RotaryEmbedding``);
* a mixture of experts per layer: a router with a bias (top-k of the logits, softmaxed
  over the k), and experts with biases whose activation is gpt-oss's clamped SwiGLU,
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
  limit)``, the gate and up columns interleaved in the checkpoint's fused ``gate_up_proj``.

Checkpoints: the fused expert tensors ``mlp.experts.gate_up_proj [E, H, 2I]`` (+ bias),
``down_proj [E, I, H]`` (+ bias), or OpenAI's MXFP4 ones (``*_blocks`` uint8 ``[E, rows,
cols/32, 16]`` holding two FP4 E2M1 values a byte, low nibble first, and ``*_scales``
uint8 E8M0 exponents ``[E, rows, cols/32]``). MXFP4 experts are dequantized to the model
dtype while loading (``dequantize_mxfp4``): the experts are not quantizable, because the
quantization methods' expert kernels (``kvloom-quant-mxfp4``'s included) compute SiLU
experts without biases, not this clamped SwiGLU with biases.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.config import EngineConfig
from kvloom.layers.fused_moe import FusedMoE, expert_groups
from kvloom.layers.linear import Linear
from kvloom.loader.lazy_tensor import CheckpointTensor, materialize
from kvloom.models.llama import LlamaForCausalLM
from kvloom.quantization.selection import quantization_method

logger = logging.getLogger(__name__)

#: The 16 values of an FP4 E2M1 code (sign bit, 2 exponent bits, 1 mantissa bit).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: E8M0 scales are powers of two with this bias.
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 to ``dtype``: ``blocks`` uint8 ``[..., G, 16]`` (32 FP4 values per group, the low
    nibble first) and ``scales`` uint8 ``[..., G]`` (``2 ** (scale - 127)`` per group) give
    ``[..., G * 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return values.flatten(-2).to(dtype)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of ``gate_up = [gate | up]`` (de-interleaved): ``(up + 1) * g *
    sigmoid(alpha * g)`` with ``g = min(gate, limit)`` and ``up`` clamped to ``[-limit, limit]``."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].clamp(max=limit)
    up = gate_up[..., inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(FusedMoE):
    """The experts of one gpt-oss layer: ``FusedMoE``'s stacked ``w13_weight [E, 2I, H]``
    (gate rows, then up rows) and ``w2_weight [E, H, I]`` plus their biases ``w13_bias``
    and ``w2_bias``, loaded from the fused checkpoint tensors (de-interleaved and
    transposed; this rank's intermediate slice under tensor parallelism) and computed with
    ``swiglu_oai``. Routing: ``select_experts`` with renormalisation (a softmax over the
    top-k logits, as HF's router)."""

    activation = "swigluoai"

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        hf = config.model.text_config
        super().__init__(
            hf.num_local_experts, hf.num_experts_per_tok, hf.hidden_size, hf.intermediate_size, renormalize=True,
            prefix=prefix, parallel=True, quantizable=False,
        )  # fmt: skip
        self.swiglu_alpha = float(getattr(hf, "swiglu_alpha", 1.702))
        self.swiglu_limit = float(getattr(hf, "swiglu_limit", 7.0))
        dtype = self.params_dtype
        self.w13_bias = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, dtype=dtype),
                                     requires_grad=False)  # fmt: skip
        self.w2_bias = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, dtype=dtype), requires_grad=False)
        self._mxfp4_parts: dict[str, torch.Tensor] = {}  # a blocks tensor waiting for its scales (or back)

    # ------------------------------------------------------------------ loading
    def checkpoint_shards(self, param_name: str) -> list[tuple[str, str | None]]:
        fused = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj",
                 "w13_bias": "gate_up_proj_bias", "w2_bias": "down_proj_bias"}  # fmt: skip
        if param_name not in fused:
            return super().checkpoint_shards(param_name)
        name = fused[param_name]
        if param_name.endswith("_weight") and self._mxfp4:
            return [(f"{name}_blocks", "blocks"), (f"{name}_scales", "scales")]
        return [(name, "fused")]

    @property
    def _mxfp4(self) -> bool:
        return getattr(self, "checkpoint_format", None) == "mxfp4"

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        if shard in ("blocks", "scales"):
            name = "w13" if param is self.w13_weight else "w2"
            other = "scales" if shard == "blocks" else "blocks"
            waiting = self._mxfp4_parts.pop(f"{name}.{other}", None)
            if waiting is None:
                self._mxfp4_parts[f"{name}.{shard}"] = materialize(loaded)
                return
            blocks, scales = (materialize(loaded), waiting) if shard == "blocks" else (waiting, materialize(loaded))
            # [E, rows, G, 16] -> [E, rows, cols]: rows are gate/up interleaved (w13) or hidden (w2).
            loaded = dequantize_mxfp4(blocks, scales, self.params_dtype)
            self._load_expert_rows(param, loaded)
            return
        if shard != "fused":
            super().weight_loader(param, loaded, shard)
            return
        tensor = materialize(loaded)
        if param is self.w13_weight:  # [E, H, 2I] with gate/up interleaved columns
            self._load_expert_rows(param, tensor.transpose(1, 2))
        elif param is self.w2_weight:  # [E, I, H]
            self._load_expert_rows(param, tensor.transpose(1, 2))
        elif param is self.w13_bias:  # [E, 2I] interleaved
            param.data.copy_(self._this_rank_gate_up(tensor))
        else:  # w2_bias [E, H]: added once, by tensor-parallel rank 0 (the ranks' outputs are summed)
            param.data.copy_(tensor if self.tp_rank == 0 else torch.zeros_like(tensor))

    def _this_rank_gate_up(self, interleaved: torch.Tensor) -> torch.Tensor:
        """``[E, 2I, ...]`` with gate/up interleaved along dim 1 -> this rank's ``[E, 2I/tp,
        ...]``: its gate slice, then its up slice."""
        start, size = self.tp_rank * self.intermediate_size, self.intermediate_size
        gate = interleaved[:, 0::2].narrow(1, start, size)
        up = interleaved[:, 1::2].narrow(1, start, size)
        return torch.cat((gate, up), dim=1)

    def _load_expert_rows(self, param: nn.Parameter, rows: torch.Tensor) -> None:
        """``rows``: the whole ``[E, 2I, H]`` (interleaved) for ``w13_weight``, ``[E, H, I]`` for ``w2_weight``."""
        if param is self.w13_weight:
            rows = self._this_rank_gate_up(rows)
        else:
            rows = rows.narrow(2, self.tp_rank * self.intermediate_size, self.intermediate_size)
        if tuple(rows.shape) != tuple(param.shape):
            raise ValueError(f"{self.prefix}: checkpoint experts have shape {tuple(rows.shape)} on this rank, "
                             f"expected {tuple(param.shape)}")  # fmt: skip
        param.data.copy_(rows)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(router_logits)
        # The grouped path reads group sizes on the host: neither a CUDA-graph capture nor
        # torch.compile (a graph without breaks) can hold that, so both run the dense one.
        # is_compiling() comes first: Dynamo folds it to a constant and never traces the
        # capture query, which it cannot.
        if torch.compiler.is_compiling() or (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            out = self._experts_dense(hidden_states, topk_weights, topk_ids)
        else:
            out = self._experts_grouped(hidden_states, topk_weights, topk_ids)
        return self._reduce(out)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        from kvloom.distributed import parallel_state

        return parallel_state.all_reduce(out) if self.tp_size > 1 else out  # type: ignore[return-value]

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.w13_weight[expert], self.w13_bias[expert])
        act = swiglu_oai(gate_up, self.swiglu_alpha, self.swiglu_limit)
        return F.linear(act, self.w2_weight[expert], self.w2_bias[expert])

    def _experts_grouped(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert with tokens on its rows (the group sizes are read on the host), the
        weighted outputs added in expert order, as HF's loop."""
        out = torch.zeros_like(hidden)
        for expert, rows, w in expert_groups(weights, ids, self.num_experts):
            out.index_add_(0, rows, (self._expert(expert, hidden[rows]) * w[:, None]).to(out.dtype))
        return out

    def _experts_dense(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by its routing weight (zero where not
        chosen): no host synchronisation, for CUDA-graph capture of small decode batches."""
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):
            w = (weights * (ids == expert)).sum(dim=1)
            out += (self._expert(expert, hidden) * w[:, None]).to(out.dtype)
        return out


class GptOssMoE(nn.Module):
    """HF's ``mlp``: the router (a linear layer with a bias, replicated) and the experts."""

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.text_config
        self.router = Linear(hf.hidden_size, hf.num_local_experts, bias=True, prefix=f"{prefix}.router",
                             quantizable=False)  # fmt: skip
        self.experts = GptOssExperts(config, f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (see the module docstring): Llama's decoder, attention with biases and sinks,
    ``GptOssMoE`` feed-forward blocks."""

    has_attention_sinks = True
    """The attention backend must support sinks (``HasAttentionSinks``)."""
    supports_tensor_parallel = True
    """Heads (and their sinks), experts' intermediate dimension and vocabulary are split."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__(config, prefix)
        mxfp4 = quantization_method(config.model.hf_config) == "mxfp4"
        if mxfp4:
            # Selection logs the chosen method (kvloom-quant-mxfp4's, when installed) as if it
            # ran the MXFP4 experts; say that gpt-oss's experts do not run it.
            logger.info("gpt-oss: the checkpoint's MXFP4 experts are dequantized to %s at load (the quantization "
                        "methods' expert kernels compute SiLU experts without biases, not gpt-oss's clamped "
                        "SwiGLU with biases)", config.model.dtype)  # fmt: skip
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.checkpoint_format = "mxfp4" if mxfp4 else None

    @classmethod
    def attention_kwargs(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sinks": True}

    @classmethod
    def mlp_block(cls, config: EngineConfig, layer_idx: int, prefix: str) -> tuple[str, nn.Module]:
        return "mlp", GptOssMoE(config, f"{prefix}.mlp")
