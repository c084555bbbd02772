"""The quantization-method conformance kit: a method's layers against its dequantized reference.

Every case builds one of kvloom's layers (``MergedLinear`` / ``QKVLinear`` / ``Linear``,
replicated, column- or row-parallel as rank ``r`` of ``tp``; ``FusedMoE``; ``VocabEmbedding``
and ``LMHead``) as the model loader does, inside the method's build context, on fresh
random float weights of odd sizes (not multiples of 16 or 128) written to the method's
checkpoint format by its own writer (``LayerQuantMethod.checkpoint_tensors``), loads them
through the layer's weight loader (shard by shard, this rank's part cut by the
parameters' layouts), runs ``process_weights_after_loading`` and checks:

- the dequantized weight (``dequantize``) against the float weight this rank holds:
  ``||deq - w|| / ||w|| <= weight_rtol`` (catches a shard in the wrong rows, a wrong rank
  slice, a wrong scale; the quantization error itself is far smaller);
- the forward against a float64 reference: ``reference_input(x) @ dequantize().T (+ bias)``
  (for experts, the routed sum with each GEMM's input through ``reference_input``):
  ``||out - ref|| / ||ref|| <= forward tolerance`` of the dtype (``DEFAULT_QUANT_TOLERANCES``).
  A row-parallel rank's partial product is checked before the all-reduce (there is no
  group here: the rank's state is set for the layer's construction only).

Python, in a method package's tests::

    import pytest
    from kvloom.testing.quantization import check_quantization_case, quantization_cases
    from my_method import MyMethod

    METHOD = MyMethod({"quant_method": "mine", ...})  # or MyMethod(None) for online

    @pytest.mark.parametrize("case", quantization_cases(METHOD), ids=str)
    def test_conformance(case):
        check_quantization_case(METHOD, case)

``run_quantization_conformance(method)`` runs every case and returns the results.

Whole checkpoints: ``write_quantized_checkpoint(src, dst, method, quantization_config)``
writes an HF checkpoint's projections and experts in the method's format (its writer;
the router, norms, embedding and LM head stay float, as the published checkpoints keep
them), for end-to-end tests of a tiny model.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.distributed import parallel_state
from kvloom.layers.fused_moe import FusedMoE
from kvloom.layers.linear import Linear, MergedLinear, QKVLinear
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding
from kvloom.loader.model_loader import default_dtype
from kvloom.quantization.context import building_model
from kvloom.quantization.method import LayerInfo, LayerKind, QuantizationMethod

__all__ = [
    "DEFAULT_QUANT_TOLERANCES",
    "QuantizationCase",
    "build_case_layer",
    "check_quantization_case",
    "quantization_cases",
    "run_quantization_conformance",
    "write_quantized_checkpoint",
]

#: Forward tolerances (relative Frobenius error) by layer kind and dtype. Experts quantize
#: an intermediate activation that the reference computes in float64: an element on a
#: rounding boundary may round the other way, so their float32 bound is wider.
DEFAULT_QUANT_TOLERANCES: dict[str, dict[torch.dtype, float]] = {
    "linear": {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3},
    "fused_moe": {torch.float32: 1e-2, torch.bfloat16: 4e-2, torch.float16: 1.5e-2},
    "embedding": {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3},
}

#: (merged module, checkpoint module, shard) of the layers the cases build (Llama's names).
_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", "0"), ("gate_up_proj", "up_proj", "1"))  # fmt: skip


@dataclass(frozen=True)
class QuantizationCase:
    """One layer to build, load and check."""

    name: str
    """What the case is (``qkv``, ``gate_up column tp2 rank1``, ...)."""
    kind: LayerKind
    """The layer kind."""
    dtype: torch.dtype = torch.float32
    """The model (activation) dtype."""
    tp_size: int = 1
    """Tensor-parallel ranks the layer is split over."""
    tp_rank: int = 0
    """The rank built."""
    seed: int = 0
    """The seed of the case's weights and inputs."""
    input_multiple: int = 1
    """The layers' input features are rounded up to a multiple of this (a format whose
    blocks run along the input, such as GGUF's 32 or 256 weights, cannot store others)."""

    def __str__(self) -> str:
        return f"{self.name}-{str(self.dtype).removeprefix('torch.')}"


def quantization_cases(
    method: QuantizationMethod, dtypes: tuple[torch.dtype, ...] | None = None, input_multiple: int = 1
) -> list[QuantizationCase]:
    """The cases of ``method``: each layer kind it declares, in each of ``dtypes`` (default:
    float32 and bfloat16 where declared), tensor-parallel ones when it declares support;
    input features rounded up to a multiple of ``input_multiple`` (``QuantizationCase``)."""
    dtypes = dtypes or tuple(d for d in (torch.float32, torch.bfloat16) if d in method.supported_dtypes)
    names: list[tuple[str, LayerKind, int, int]] = []
    if LayerKind.LINEAR in method.layer_kinds:
        names += [("linear", LayerKind.LINEAR, 1, 0), ("qkv", LayerKind.LINEAR, 1, 0),
                  ("gate_up", LayerKind.LINEAR, 1, 0)]  # fmt: skip
        if method.supports_tensor_parallel:
            names += [("qkv column", LayerKind.LINEAR, 2, 1), ("gate_up column", LayerKind.LINEAR, 2, 1),
                      ("down row", LayerKind.LINEAR, 2, 1)]  # fmt: skip
    if LayerKind.FUSED_MOE in method.layer_kinds:
        names.append(("experts", LayerKind.FUSED_MOE, 1, 0))
        if method.supports_tensor_parallel:
            names.append(("experts", LayerKind.FUSED_MOE, 2, 1))
    for kind in (LayerKind.EMBEDDING, LayerKind.LM_HEAD):
        if kind in method.layer_kinds:
            names.append((kind.value, kind, 1, 0))
    return [QuantizationCase(f"{name}{f' tp{tp} rank{rank}' if tp > 1 else ''}", kind, dtype, tp, rank, seed,
                             input_multiple)
            for seed, (name, kind, tp, rank) in enumerate(names) for dtype in dtypes]  # fmt: skip


@contextmanager
def _rank(tp_size: int, tp_rank: int) -> Iterator[None]:
    """Layers built inside see themselves as rank ``tp_rank`` of ``tp_size`` (no group)."""
    saved = parallel_state._STATE
    parallel_state._STATE = parallel_state._ParallelState(rank=tp_rank, world_size=tp_size, tp_size=tp_size)
    try:
        yield
    finally:
        parallel_state._STATE = saved


def build_case_layer(method: QuantizationMethod, case: QuantizationCase) -> nn.Module:
    """The kvloom layer of ``case`` (this rank's part, built as the model loader builds it,
    inside ``method``'s build context), its quantized parameters created and not loaded:
    for a method's own checks of loading paths the kit does not take (checkpoint tensors
    stored another way, e.g. stacked experts). Layer kinds and sizes: see ``quantization_cases``."""
    parallel = case.tp_size > 1

    def inputs(n: int) -> int:
        return -(-n // case.input_multiple) * case.input_multiple

    with _rank(case.tp_size, case.tp_rank), default_dtype(case.dtype), building_model(method, _STACKED):
        # Sizes are odd on purpose; tensor-parallel ones split on 256 rows/columns (any block up to 256).
        if case.name.startswith("linear"):
            return Linear(inputs(200), 150, bias=True, prefix="model.layers.0.mlp.down_proj")
        if case.name.startswith("qkv"):
            if parallel:
                return QKVLinear(inputs(512), 128, 4, 2, bias=True, prefix="model.layers.0.self_attn.qkv_proj",
                                 parallel=True)  # fmt: skip
            return QKVLinear(inputs(160), 40, 3, 1, bias=True, prefix="model.layers.0.self_attn.qkv_proj")
        if case.name.startswith("gate_up"):
            sizes, hidden = ([512, 512], 256) if parallel else ([176, 176], 144)
            return MergedLinear(inputs(hidden), sizes, prefix="model.layers.0.mlp.gate_up_proj",
                                parallel="column" if parallel else "replicated")  # fmt: skip
        if case.name.startswith("down"):
            return Linear(inputs(512), 96, bias=True, prefix="model.layers.0.mlp.down_proj", parallel="row")
        if case.kind is LayerKind.FUSED_MOE:
            inter = 512 if parallel else inputs(80)
            return FusedMoE(4, 2, inputs(144), inter, renormalize=True, prefix="model.layers.1.mlp.experts",
                            parallel=parallel)  # fmt: skip
        cls = LMHead if case.kind is LayerKind.LM_HEAD else VocabEmbedding
        return cls(300, inputs(144), prefix="lm_head" if cls is LMHead else "model.embed_tokens")


def _load(layer: nn.Module, param_prefix: str, tensors: dict[str, torch.Tensor], shard: str | None) -> None:
    for suffix, tensor in tensors.items():
        name = param_prefix + suffix
        param = layer._parameters.get(name)
        assert param is not None, (f"the format writer made a {suffix!r} tensor, but the layer has no parameter "
                                   f"{name!r} (it has {sorted(layer._parameters)})")  # fmt: skip
        layer.weight_loader(param, tensor, shard)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-30))


def _check(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, case: QuantizationCase) -> None:
    shapes = f"{case}: {what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.shape == expected.shape, shapes
    error = _relative_error(actual, expected)
    assert torch.isfinite(actual).all() and error <= rtol, (
        f"{case}: {what} relative error {error:.3g} > {rtol:.3g} (seed {case.seed})"
    )


def check_quantization_case(
    method: QuantizationMethod,
    case: QuantizationCase,
    *,
    weight_rtol: float = 0.15,
    rtol: float | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """Build, load and check one case (see the module docstring); an ``AssertionError``
    names the case, the check and the error. Returns the forward's relative error.
    ``device``: where the layer is built and run (``"cuda"``: the method's GPU kernels;
    the random data are drawn on the host, so a case is the same data everywhere)."""
    with torch.device(device):
        layer = build_case_layer(method, case)
        qm = layer.quant_method
        assert qm is not None, f"{case}: {method.NAME} left the layer unquantized (layer_method returned None)"
        g = torch.Generator().manual_seed(case.seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device="cpu").to(device)

        if case.kind is LayerKind.LINEAR:
            return _check_linear(layer, case, rand, weight_rtol, rtol)
        if case.kind is LayerKind.FUSED_MOE:
            return _check_moe(layer, case, rand, weight_rtol, rtol)
        return _check_embedding(layer, case, rand, weight_rtol, rtol)


def _tolerance(kind: str, case: QuantizationCase, rtol: float | None) -> float:
    return rtol if rtol is not None else DEFAULT_QUANT_TOLERANCES[kind][case.dtype]


def _check_linear(layer, case, rand, weight_rtol, rtol) -> float:  # type: ignore[no-untyped-def]
    qm = layer.quant_method
    full = {shard: rand(n, layer.full_input_size) * 0.1 for shard, n in zip(layer.shard_names, layer.full_output_sizes)}
    merged = len(layer.shard_names) > 1
    for shard, weight in full.items():
        _load(layer, "", qm.checkpoint_tensors(weight), shard if merged else None)
    if layer.bias is not None:
        layer.bias.data.copy_(rand(layer.output_size) * 0.1)
    qm.process_weights_after_loading(layer)
    # What this rank holds of the float weight.
    rows = []
    for index, shard in enumerate(layer.shard_names):
        start = layer.shard_starts[index] if layer.parallel == "column" else 0
        rows.append(full[shard][start : start + layer.output_sizes[index]])
    expected = torch.cat(rows)
    if layer.parallel == "row":
        expected = expected[:, layer.tp_rank * layer.input_size : (layer.tp_rank + 1) * layer.input_size]
    _check("dequantized weight", qm.dequantize(layer), expected, weight_rtol, case)
    x = (rand(11, layer.input_size) * 2.0).to(case.dtype)
    bias = None if layer.parallel == "row" else layer.bias
    with torch.no_grad():
        out = qm.apply(layer, x, bias)
    ref = qm.reference_input(layer, x).double() @ qm.dequantize(layer).double().T
    if bias is not None:
        ref = ref + bias.double()
    assert out.dtype == case.dtype, f"{case}: apply returned {out.dtype}, expected {case.dtype}"
    tol = _tolerance("linear", case, rtol)
    _check("forward", out, ref, tol, case)
    return _relative_error(out, ref)


def _check_moe(layer, case, rand, weight_rtol, rtol) -> float:  # type: ignore[no-untyped-def]
    qm = layer.quant_method
    e, hidden, inter, full = layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.full_intermediate_size
    weights = {(i, kind): rand(*((hidden, full) if kind == "down" else (full, hidden))) * 0.1
               for i in range(e) for kind in ("gate", "up", "down")}  # fmt: skip
    for (i, kind), w in weights.items():
        _load(layer, "w2_" if kind == "down" else "w13_", qm.checkpoint_tensors(w), f"{i}.{kind}")
    qm.process_weights_after_loading(layer)
    lo, hi = layer.tp_rank * inter, (layer.tp_rank + 1) * inter
    w13 = torch.stack([torch.cat([weights[(i, "gate")][lo:hi], weights[(i, "up")][lo:hi]]) for i in range(e)])
    w2 = torch.stack([weights[(i, "down")][:, lo:hi] for i in range(e)])
    d13, d2 = qm.dequantize(layer)
    _check("dequantized w13", d13, w13, weight_rtol, case)
    _check("dequantized w2", d2, w2, weight_rtol, case)
    x = (rand(9, hidden) * 2.0).to(case.dtype)
    topk_weights, topk_ids = layer.select_experts(rand(9, e))
    with torch.no_grad():
        out = qm.apply(layer, x, topk_weights, topk_ids)
    ref = torch.zeros(9, hidden, dtype=torch.float64)
    xq = qm.reference_input(layer, x, "w13").double()
    for i in range(e):
        gate_up = xq @ d13[i].double().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = qm.reference_input(layer, act, "w2").double() @ d2[i].double().T
        routed = (topk_weights.double() * (topk_ids == i)).sum(dim=-1, keepdim=True)
        ref += routed * down
    _check("forward", out, ref, _tolerance("fused_moe", case, rtol), case)
    return _relative_error(out, ref)


def _check_embedding(layer, case, rand, weight_rtol, rtol) -> float:  # type: ignore[no-untyped-def]
    qm = layer.quant_method
    table = rand(layer.num_embeddings, layer.embedding_dim) * 0.1
    _load(layer, "", qm.checkpoint_tensors(table), None)
    qm.process_weights_after_loading(layer)
    deq = qm.dequantize(layer)
    _check("dequantized table", deq, table, weight_rtol, case)
    ids = torch.randint(0, layer.num_embeddings, (13,), generator=torch.Generator().manual_seed(case.seed),
                        device="cpu").to(deq.device)
    with torch.no_grad():
        looked_up = qm.embedding(layer, ids)
    _check("embedding", looked_up, deq[ids].double(), _tolerance("embedding", case, rtol), case)
    x = (rand(7, layer.embedding_dim) * 2.0).to(case.dtype)
    with torch.no_grad():
        logits = qm.apply(layer, x)
    ref = qm.reference_input(layer, x).double() @ deq.double().T
    _check("logits", logits, ref, _tolerance("linear", case, rtol), case)
    return _relative_error(logits, ref)


def run_quantization_conformance(method: QuantizationMethod) -> dict[str, str]:
    """Every case of ``method``: case name -> ``"ok (error ...)"`` or the failure message."""
    results: dict[str, str] = {}
    for case in quantization_cases(method):
        try:
            results[str(case)] = f"ok (forward error {check_quantization_case(method, case):.2g})"
        except AssertionError as exc:
            results[str(case)] = f"FAILED: {exc}"
    return results


#: Checkpoint names of the projections a quantized checkpoint stores quantized: attention
#: and MLP projections (``*_proj.weight``; not a router, ``mlp.gate``) and experts.
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.\w+\.weight$")
_PROJECTION = re.compile(r"^(?P<module>.+_proj)\.weight$")


def write_quantized_checkpoint(
    src: str | Path, dst: str | Path, method: QuantizationMethod, quantization_config: dict[str, Any] | None
) -> Path:
    """Copy the HF checkpoint ``src`` (one ``model.safetensors``, tokenizer and config files)
    to ``dst`` with every projection the method quantizes (``layer_method`` of its
    ``Linear``, or ``FusedMoE`` for experts) replaced by the tensors of its format writer
    (``checkpoint_tensors``), and ``quantization_config`` in ``config.json`` (left out when
    ``None``). Returns ``dst``."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in load_file(src / "model.safetensors").items():
        if (match := _EXPERT.match(name)) is not None and LayerKind.FUSED_MOE in method.layer_kinds:
            info_kind, module = LayerKind.FUSED_MOE, match["module"]
        elif (match := _PROJECTION.match(name)) is not None and LayerKind.LINEAR in method.layer_kinds:
            info_kind, module = LayerKind.LINEAR, match["module"]
        else:
            tensors[name] = weight
            continue
        info = LayerInfo(info_kind, module, (module,), weight.shape[1], (weight.shape[0],))
        layer = method.layer_method(info)
        if layer is None:
            tensors[name] = weight
            continue
        base = name.removesuffix(".weight")
        tensors.update({f"{base}.{suffix}": t.contiguous() for suffix, t in layer.checkpoint_tensors(weight).items()})
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
