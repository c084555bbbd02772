"""Mixture of experts: top-k routing (``select_experts``) and the expert layer (``FusedMoE``).

An MoE feed-forward block replaces the dense MLP by ``E`` expert MLPs of which each token
uses ``top_k``, weighted by a router. kvloom keeps the experts of a layer stacked in two
parameters, in the layout the grouped kernels read:

* ``w13_weight [E, 2 * I, H]``: per expert the ``gate_proj`` rows, then the ``up_proj`` rows;
* ``w2_weight [E, H, I]``: per expert the ``down_proj``.

Checkpoints store one tensor per expert and projection (``experts.3.gate_proj.weight``,
Mixtral's ``experts.3.w1.weight``); ``FusedMoE.checkpoint_shards`` names them and
``FusedMoE.weight_loader`` copies each into its slice, so the generic loader
(``kvloom.models.weights.load_checkpoint_weights``) stacks the experts at load time.

The expert computation is the custom op ``fused_moe`` (``kvloom.layers.custom_ops``): a
platform may replace ``fused_moe_torch`` (tokens grouped by expert, one GEMM per expert
that has tokens, host-synchronising: the CPU path) by grouped-GEMM kernels (the CUDA
platform's Triton kernels).

Tensor parallelism (``parallel=True``): every rank keeps all ``E`` experts, each cut along
its intermediate dimension as the dense MLP is: rank ``r`` holds rows ``[r * I/tp, (r+1) *
I/tp)`` of every expert's gate and of its up projection (``w13_weight [E, 2 * I/tp, H]``,
the gate slice then the up slice, so ``silu(gate) * up`` pairs the same columns) and the
same columns of its down projection (``w2_weight [E, H, I/tp]``). Routing runs whole on
every rank (the router is replicated); each rank's ``fused_moe`` then yields a partial sum
of every token's weighted expert outputs, and one all-reduce after the combine adds them,
not one per expert. The ``fused_moe`` op takes the weights as given: it reads ``I/tp``
from their shapes.

Quantization: built while the model loader quantizes the model, the layer asks the method
for its ``FusedMoEQuantMethod`` (``quant_method``, None when unquantized), which creates
the expert parameters (``w13_weight``, ``w13_weight_scale``, ``w2_weight``, ...: ``w13_`` /
``w2_`` plus the checkpoint tensor's suffix, so ``experts.3.up_proj.weight_scale`` loads
into ``w13_weight_scale``), and computes the experts instead of the ``fused_moe`` op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.distributed import parallel_state
from kvloom.layers.custom_ops import get_custom_op
from kvloom.loader.lazy_tensor import CheckpointTensor, materialize
from kvloom.quantization.context import layer_quant_method
from kvloom.quantization.layer_methods import FusedMoEQuantMethod, Span, load_per_shard, load_region
from kvloom.quantization.method import LayerKind
from kvloom.utils import cdiv

SCORING_FUNCS = ("softmax", "sigmoid")
#: HF's DeepSeek-V3 adds this to the sum of the chosen sigmoid scores before dividing.
_SIGMOID_RENORM_EPS = 1e-20


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_routing(
    num_experts: int,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the field unless the routing parameters are consistent."""
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group and topk_group must be given together (group-limited top-k), got "
            f"num_expert_group={num_expert_group!r}, topk_group={topk_group!r}"
        )
    if num_expert_group is not None and topk_group is not None:
        _check_positive_int("num_expert_group", num_expert_group)
        if num_experts % num_expert_group:
            raise ValueError(
                f"num_expert_group must divide num_experts={num_experts}, got {num_expert_group}"
            )
        _check_positive_int("topk_group", topk_group)
        if topk_group > num_expert_group:
            raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}")
        kept = topk_group * (num_experts // num_expert_group)
        if top_k > kept:
            raise ValueError(
                f"top_k must be at most the experts of the kept groups (topk_group * num_experts / "
                f"num_expert_group = {kept}), got {top_k}"
            )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights: ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.

    In float32, as HF transformers' routers:

    1. scores: ``softmax(router_logits)`` (Mixtral, Qwen3-MoE, DeepSeek-V2) or
       ``sigmoid(router_logits)`` (DeepSeek-V3);
    2. the experts are chosen by ``scores + e_score_correction_bias`` (the bias steers the
       choice only, DeepSeek-V3), by the plain scores without a bias;
    3. group-limited top-k (``num_expert_group`` groups of consecutive experts, keep the best
       ``topk_group``): a group scores the max of its experts (DeepSeek-V2's
       ``group_limited_greedy``), or with a correction bias the sum of its best two
       (DeepSeek-V3); experts of the other groups are not chosen;
    4. the ``top_k`` best experts; their weights are the unbiased scores, divided by their
       sum when ``renormalize`` (DeepSeek-V3 adds 1e-20 to a sigmoid sum, as HF), then
       times ``routed_scaling_factor``.

    Without groups the top-k is sorted (HF's ``torch.topk`` default for Mixtral and
    Qwen3-MoE), with groups unsorted (HF's DeepSeek routers): the order of the ``k``
    slots decides the order in which a renormalisation sums them.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or not router_logits.is_floating_point():
        shape = tuple(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits).__name__
        raise ValueError(f"router_logits must be a floating-point [tokens, num_experts] tensor, got {shape}")
    num_tokens, num_experts = router_logits.shape
    check_routing(num_experts, top_k, scoring_func=scoring_func, num_expert_group=num_expert_group, topk_group=topk_group)
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias must have shape ({num_experts},), got {tuple(e_score_correction_bias.shape)}"
        )
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and topk_group is not None:
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
        topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    else:
        topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if scoring_func == "sigmoid":
            denominator = denominator + _SIGMOID_RENORM_EPS
        topk_weights = topk_weights / denominator
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def expert_groups(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The (token, slot) pairs of a routing grouped by expert, in HF's order: for each
    expert with tokens, ascending, ``(expert, rows, weights)``, its token rows and their
    routing weights. Within a group the pairs are slot-major (pair ``p = slot * T + token``,
    a stable sort of the expert ids), as HF's ``torch.where`` lists them. Reads the group
    sizes on the host (not for CUDA graphs)."""
    num_tokens = topk_ids.shape[0]
    flat_ids = topk_ids.t().reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order % num_tokens
    slots = order // num_tokens
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        yield expert, rows, topk_weights[rows, slots[start : start + count]]
        start += count


def fused_moe_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    down_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch code of the ``fused_moe`` op, HF transformers' arithmetic:

    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``, ``gate_e``/``up_e`` the two halves of ``w13[e]`` and ``down_e``
    ``w2[e]``. The (token, slot) pairs are grouped by expert (a stable sort of the expert
    ids, slot-major as HF's ``torch.where`` lists them); each expert with tokens runs its
    gate/up GEMM, SiLU-and-mul and down GEMM on its rows; the weighted rows are added into
    the output expert by expert (ascending), each product rounded to ``hidden``'s dtype
    first, as HF's ``index_add_``. Reads the group sizes on the host (not for CUDA graphs).
    ``down_input`` (not part of the op) transforms each expert's down-projection input
    rows first: a W8A8 quantization method's activation quantization.
    """
    num_tokens = topk_ids.shape[0]
    intermediate = w2.shape[-1]
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    for expert, rows, weights in expert_groups(topk_weights, topk_ids, w13.shape[0]):
        gate_up = F.linear(hidden[rows], w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        if down_input is not None:
            act = down_input(act)
        expert_out = F.linear(act, w2[expert]) * weights[:, None]
        out.index_add_(0, rows, expert_out.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]``,
    the sum over each token's ``top_k`` experts (``select_experts``) of its routing weight
    times the expert's gated MLP ``down(silu(gate(x)) * up(x))``.

    Parameters: ``w13_weight [E, 2 * I, H]`` (gate rows, then up rows), ``w2_weight [E, H, I]``
    and, with ``use_correction_bias``, ``e_score_correction_bias [E]`` (float32; DeepSeek-V3
    stores it on its router as ``mlp.gate.e_score_correction_bias``: the model maps it).
    ``expert_weight_names`` are the checkpoint names of an expert's gate, up and down
    projections (Mixtral: ``("w1", "w3", "w2")``), each under ``<prefix>.<expert id>.``.
    The router (its linear layer, its dtype) and shared experts belong to the model.

    ``parallel``: shard every expert's intermediate dimension over the tensor-parallel
    ranks (see the module docstring); ``intermediate_size`` is the checkpoint's (whole)
    size, ``self.intermediate_size`` this rank's. ``forward`` then all-reduces its output.
    """

    accepts_lazy_weights = True
    """``weight_loader`` takes ``LazyTensor`` handles and reads only this rank's
    intermediate range of each expert."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        use_correction_bias: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        params_dtype: torch.dtype | None = None,
        expert_weight_names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
        prefix: str = "",
        parallel: bool = False,
        quantizable: bool = True,
    ) -> None:
        super().__init__()
        check_routing(num_experts, top_k, scoring_func=scoring_func, num_expert_group=num_expert_group,
                      topk_group=topk_group)  # fmt: skip
        _check_positive_int("hidden_size", hidden_size)
        _check_positive_int("intermediate_size", intermediate_size)
        if len(expert_weight_names) != 3:
            raise ValueError(f"expert_weight_names must be (gate, up, down) names, got {tuple(expert_weight_names)}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.tp_size = parallel_state.tp_world_size() if parallel else 1
        self.tp_rank = parallel_state.tp_rank() if parallel else 0
        if intermediate_size % self.tp_size:
            raise ValueError(f"{prefix or 'FusedMoE'} intermediate_size: {intermediate_size} is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")  # fmt: skip
        self.full_intermediate_size = intermediate_size
        intermediate_size //= self.tp_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.expert_weight_names = tuple(expert_weight_names)
        self.prefix = prefix
        dtype = params_dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        # quantizable=False: experts whose arithmetic the methods' kernels do not compute
        # (gpt-oss's biases and clamped SwiGLU) never get a method.
        self.quant_method: FusedMoEQuantMethod | None = None
        if quantizable:
            self.quant_method = layer_quant_method(  # type: ignore[assignment]
                LayerKind.FUSED_MOE, prefix, input_size=hidden_size, output_sizes=(self.full_intermediate_size,),
                tp_size=self.tp_size, num_experts=num_experts,
            )  # fmt: skip
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
        else:
            self.w13_weight = nn.Parameter(
                torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
            )
            self.w2_weight = nn.Parameter(
                torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
            )
        if use_correction_bias:
            self.e_score_correction_bias: nn.Parameter | None = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)

    # ------------------------------------------------------------------ weight loading

    def checkpoint_shards(self, param_name: str) -> list[tuple[str, str | None]]:
        """The checkpoint tensors that make up the parameter ``param_name`` of this module:
        ``(name relative to the module, shard for weight_loader)``; read by
        ``kvloom.models.weights.checkpoint_names`` (HF name = ``<module name>.<relative name>``)."""
        stacked = self.quant_method.checkpoint_shards(self, param_name) if self.quant_method is not None else None
        if stacked is not None:
            return stacked
        gate, up, down = self.expert_weight_names
        # w13_<suffix> / w2_<suffix>: the experts' <suffix> tensors ("weight", "weight_scale", ...).
        projection, _, suffix = param_name.partition("_")
        if projection == "w13" and suffix:
            return [(f"{e}.{name}.{suffix}", f"{e}.{kind}") for e in range(self.num_experts)
                    for name, kind in ((gate, "gate"), (up, "up"))]  # fmt: skip
        if projection == "w2" and suffix:
            return [(f"{e}.{down}.{suffix}", f"{e}.down") for e in range(self.num_experts)]
        if param_name == "e_score_correction_bias" and self.e_score_correction_bias is not None:
            return [("e_score_correction_bias", None)]
        raise KeyError(f"{self.prefix or 'FusedMoE'}: no parameter {param_name!r}")

    def _expert_of(self, shard: str) -> tuple[int, str]:
        expert_str, _, kind = shard.partition(".")
        if not expert_str.isdigit() or not 0 <= int(expert_str) < self.num_experts:
            raise ValueError(f"{self.prefix}: expert id in shard {shard!r} must be in [0, {self.num_experts})")
        return int(expert_str), kind

    def expert_slice(self, param: nn.Parameter, shard: str) -> torch.Tensor:
        """The view of ``param`` that the shard ``"<expert>.<gate|up|down>"`` fills."""
        expert, kind = self._expert_of(shard)
        inter = self.intermediate_size
        if param is self.w13_weight and kind in ("gate", "up"):
            return param.data[expert, :inter] if kind == "gate" else param.data[expert, inter:]
        if param is self.w2_weight and kind == "down":
            return param.data[expert]
        raise ValueError(f"{self.prefix}: shard {shard!r} does not belong to this parameter "
                         "(w13_weight: <e>.gate / <e>.up, w2_weight: <e>.down)")  # fmt: skip

    def _this_rank(self, loaded: CheckpointTensor, shard: str) -> CheckpointTensor:
        """This rank's part of a whole checkpoint projection: rows of gate/up ``[I, H]``,
        columns of down ``[H, I]``; a tensor of the wrong shape is an error naming it."""
        full, hidden = self.full_intermediate_size, self.hidden_size
        dim = 1 if shard.endswith(".down") else 0
        expected = (hidden, full) if dim == 1 else (full, hidden)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{self.prefix}: checkpoint tensor for shard {shard} has shape {tuple(loaded.shape)}, "
                             f"expected {expected}")  # fmt: skip
        return loaded.narrow(dim, self.tp_rank * self.intermediate_size, self.intermediate_size)

    def load_by_layout(self, name: str, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None) -> None:
        """Copy an expert's checkpoint tensor into the quantized parameter ``name`` by its
        ``ParamLayout`` (of one expert's slice): gate rows then up rows (each from its own
        block), this rank's intermediate range, one value per projection."""
        if shard is None:
            raise ValueError(f"{self.prefix}.{name}: an expert tensor needs a shard (<expert>.gate|up|down)")
        expert, kind = self._expert_of(shard)
        if kind not in ("gate", "up", "down") or (kind == "down") != name.startswith("w2_"):
            raise ValueError(f"{self.prefix}: shard {shard!r} does not belong to {name}")
        layout, target = self.quant_layouts[name], param.data[expert]
        what = f"{self.prefix}.{name} (shard {shard})"
        if layout.per_shard:
            load_per_shard(target, 1 if kind == "up" else 0, loaded, what)
            return
        rank_start = self.tp_rank * self.intermediate_size
        out = inp = None
        if kind != "down" and layout.output_dim is not None:
            block, dim = layout.output_block, layout.output_dim
            expected = cdiv(self.full_intermediate_size, block)
            if loaded.dim() <= dim or loaded.shape[dim] != expected:
                raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected} "
                                 f"entries along dim {dim}")  # fmt: skip
            dst = cdiv(self.intermediate_size, block) if kind == "up" else 0
            out = Span(rank_start, self.intermediate_size, dst)
        if kind == "down" and layout.input_dim is not None and self.tp_size > 1:
            inp = Span(rank_start, self.intermediate_size, 0)
        load_region(target, loaded, layout, out, inp, what)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        """Copy one checkpoint tensor into ``param``: an expert's projection into its slice
        (shard ``"<expert>.gate"``, ``"<expert>.up"``, ``"<expert>.down"``; under tensor
        parallelism only this rank's part of it, the only part read of a lazy handle), or
        the whole correction bias (no shard). A quantized layer's expert parameters go to
        its method (``FusedMoEQuantMethod.load_weight``)."""
        if self.quant_method is not None and param is not self.e_score_correction_bias:
            name = next(n for n, p in self._parameters.items() if p is param)
            self.quant_method.load_weight(self, name, param, loaded, shard)
            return
        target = param.data if shard is None else self.expert_slice(param, shard)
        if shard is not None and self.tp_size > 1:
            loaded = self._this_rank(loaded, shard)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor{'' if shard is None else f' for shard {shard}'} has shape "
                f"{tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(materialize(loaded))

    # ------------------------------------------------------------------ forward

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``select_experts`` with this layer's routing parameters."""
        return select_experts(
            router_logits, self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func,
            e_score_correction_bias=self.e_score_correction_bias, num_expert_group=self.num_expert_group,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
        )  # fmt: skip

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(router_logits)
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        else:
            op = get_custom_op("fused_moe") or fused_moe_torch
            out = op(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        # Each rank summed its slice of every expert's down projection: one all-reduce
        # for the whole layer (a no-op at tensor-parallel size 1).
        return parallel_state.all_reduce(out) if self.tp_size > 1 else out  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, scoring={self.scoring_func}, renormalize={self.renormalize}"
                + (f", tensor-parallel rank {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""))  # fmt: skip
