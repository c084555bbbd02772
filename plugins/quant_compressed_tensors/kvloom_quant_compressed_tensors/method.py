"""The ``compressed-tensors`` method: llm-compressor's checkpoint format.

The ``quantization_config`` (``config.json``) names ``config_groups``, each with
``targets`` (module class names such as ``Linear``, module names, or ``re:`` regular
expressions over module names), the quantization of its ``weights`` and
``input_activations``, and a ``format`` (else the top-level one); ``ignore`` lists the
modules left unquantized (names or ``re:`` expressions). A module takes the first group
whose targets match it, a name before a regular expression before a class name.

Formats read:

* ``float-quantized``: fp8 e4m3 weights, ``weight_scale`` per tensor ``[1]``, per channel
  ``[out, 1]`` or per block; activations dynamic per token or per group, static per
  tensor with ``input_scale``, or none (W8A16): ``kvloom-quant-fp8``'s layers;
* ``pack-quantized`` with 4-bit integer weights (W4A16): ``weight_packed``, group or
  channel ``weight_scale``, ``weight_zero_point`` when asymmetric, ``weight_g_idx`` for the
  older ``actorder: group``: ``kvloom-quant-int4``'s layers;
* ``mxfp4-pack-quantized`` (MXFP4A16: e2m1 weights, e8m0 scales per 32): ``weight_packed``
  uint8, ``weight_scale`` uint8: ``kvloom-quant-mxfp4``'s format on the same layers.

Other formats (``naive-quantized``, ``nvfp4-pack-quantized``, ...) are refused naming them;
a KV-cache scheme and sparsity too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvloom_quant_fp8 import Fp8Scheme
from kvloom_quant_fp8.method import layer_method_for
from kvloom_quant_int4.formats import Int4Format, PackQuantizedFormat
from kvloom_quant_int4.method import w4_layer_method
from kvloom_quant_mxfp4 import Mxfp4Format

from kvloom.interfaces import LayerInfo, LayerKind, LayerQuantMethod, QuantizationMethod

FORMATS = ("float-quantized", "pack-quantized", "mxfp4-pack-quantized")
#: compressed-tensors strategies -> ``Fp8Scheme``'s names.
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
#: ``actorder`` values of pack-quantized weights: those that store ``weight_g_idx``, and those that do not.
ACTORDER_WITH_G_IDX = ("group",)
ACTORDER_WITHOUT_G_IDX = (None, "weight", "static")


@dataclass(frozen=True)
class ConfigGroup:
    """One of ``config_groups``: its targets and the scheme of the modules it takes (fp8,
    or a 4-bit format)."""

    name: str
    targets: tuple[str, ...]
    scheme: Fp8Scheme | Int4Format | Mxfp4Format


def _fp8_args(args: dict[str, Any], where: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(f"{where}: type {args.get('type')!r} with num_bits {args.get('num_bits')!r} is not supported "
                         "(allowed: float with num_bits 8, fp8)")  # fmt: skip
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}.symmetric: False is not supported (allowed: True)")


def _scheme(name: str, group: dict[str, Any], default_format: str | None) -> Fp8Scheme | Int4Format | Mxfp4Format:
    where = f"config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise ValueError(f"{where}.format: {fmt!r} is not supported (allowed: {', '.join(FORMATS)})")
    weights = group.get("weights") or {}
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights: {weights!r} (allowed: an object)")
    if fmt == "pack-quantized":
        return _int4_format(where, weights, group.get("input_activations"))
    if fmt == "mxfp4-pack-quantized":
        return _mxfp4_format(where, weights, group.get("input_activations"))
    _fp8_args(weights, f"{where}.weights")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"{where}.weights.strategy: {strategy!r} (allowed: {', '.join(WEIGHT_STRATEGIES)})")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: True is not supported (allowed: False)")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        valid = isinstance(structure, list) and len(structure) == 2
        if not (valid and all(isinstance(b, int) and b > 0 for b in structure)):
            raise ValueError(f"{where}.weights.block_structure: {structure!r} (allowed: two positive ints)")
        block = (structure[0], structure[1])
    acts = group.get("input_activations")
    activations = None
    if acts is not None:
        if not isinstance(acts, dict):
            raise ValueError(f"{where}.input_activations: {acts!r} (allowed: an object or null)")
        _fp8_args(acts, f"{where}.input_activations")
        kind = (acts.get("strategy"), bool(acts.get("dynamic")))
        activations = {("token", True): "token", ("group", True): "group", ("tensor", False): "tensor"}.get(kind)
        if activations is None:
            raise ValueError(f"{where}.input_activations: strategy {kind[0]!r} with dynamic {kind[1]} is not supported "
                             "(allowed: token or group dynamic, tensor static)")  # fmt: skip
        if activations == "group" and (block is None or acts.get("group_size") != block[1]):
            raise ValueError(f"{where}.input_activations.group_size: {acts.get('group_size')!r} (allowed: the "
                             "weights' block width, with block weights)")  # fmt: skip
    return Fp8Scheme(strategy, activations, block)


def _int4_format(where: str, weights: dict[str, Any], activations: object) -> Int4Format:
    """A pack-quantized group's 4-bit weight format (W4A16 only)."""
    if weights.get("type") != "int" or weights.get("num_bits") != 4:
        raise ValueError(f"{where}.weights: type {weights.get('type')!r} with num_bits {weights.get('num_bits')!r} is "
                         "not supported with pack-quantized (allowed: int with num_bits 4)")  # fmt: skip
    if activations is not None:
        raise ValueError(f"{where}.input_activations: {activations!r} is not supported with 4-bit weights (allowed: "
                         "null, W4A16)")  # fmt: skip
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy == "channel":
        group_size = -1
    elif strategy != "group" or not isinstance(group_size, int) or group_size < 16:
        raise ValueError(f"{where}.weights: strategy {strategy!r} with group_size {group_size!r} is not supported "
                         "(allowed: group with a group_size >= 16, or channel)")  # fmt: skip
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: True is not supported (allowed: False)")
    actorder = weights.get("actorder")
    if actorder not in ACTORDER_WITH_G_IDX + ACTORDER_WITHOUT_G_IDX:
        allowed = ", ".join(str(a).lower() for a in ACTORDER_WITH_G_IDX + ACTORDER_WITHOUT_G_IDX)
        raise ValueError(f"{where}.weights.actorder: {actorder!r} (allowed: {allowed})")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{where}.weights.symmetric: {symmetric!r} (allowed: true, false)")
    return PackQuantizedFormat(group_size, zero_point=not symmetric, act_order=actorder in ACTORDER_WITH_G_IDX)


def _mxfp4_format(where: str, weights: dict[str, Any], activations: object) -> Mxfp4Format:
    """An mxfp4-pack-quantized group's format (MXFP4A16 only)."""
    kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"), weights.get("group_size"))
    if kind != ("float", 4, "group", 32):
        raise ValueError(f"{where}.weights: type, num_bits, strategy, group_size {kind} are not supported with "
                         "mxfp4-pack-quantized (allowed: float, 4, group, 32)")  # fmt: skip
    if activations is not None:
        raise ValueError(f"{where}.input_activations: {activations!r} is not supported with MXFP4 weights (allowed: "
                         "null, MXFP4A16)")  # fmt: skip
    return Mxfp4Format()


def _layer_method(layer: LayerInfo, scheme: Fp8Scheme | Int4Format | Mxfp4Format) -> LayerQuantMethod | None:
    if isinstance(scheme, Fp8Scheme):
        return layer_method_for(layer, scheme)
    return w4_layer_method(layer, scheme)


def target_rank(target: str, module: str) -> int | None:
    """How closely ``target`` names checkpoint module ``module``: 0 by name, 1 by a ``re:``
    expression, 2 by the class ``Linear`` (every module kvloom asks about is a linear
    projection or an expert's); None: not at all."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) else None
    if target == module:
        return 0
    return 2 if target == "Linear" else None


class CompressedTensorsMethod(QuantizationMethod):
    """compressed-tensors checkpoints (``float-quantized``: fp8 W8A8 / W8A16; ``pack-quantized``: int4
    W4A16; ``mxfp4-pack-quantized``: MXFP4A16)."""

    NAME = "compressed-tensors"
    checkpoint_formats = {"compressed-tensors": FORMATS}
    layer_kinds = (LayerKind.LINEAR, LayerKind.FUSED_MOE)
    weight_dtype = "float8_e4m3fn (per-tensor, per-channel or block scales), int4 (group or channel scales) or mxfp4"
    activation_dtype = "float8_e4m3fn (dynamic per token or group, static per tensor) or the model dtype (W8A16, W4A16)"

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        config = self.quantization_config
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_status: {status!r} is not supported (allowed: compressed; save the model "
                             "with its compressor)")  # fmt: skip
        for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if config.get(field):
                raise ValueError(f"{field}: {config[field]!r} is not supported yet (allowed: none)")
        groups = config.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
            raise ValueError(f"config_groups: {groups!r} (allowed: a dict of at least one group, each a dict)")
        for name, group in groups.items():
            targets = group.get("targets")
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"config_groups.{name}.targets: {targets!r} (allowed: a list of names)")
        self.groups = [
            ConfigGroup(name, tuple(group.get("targets") or ()), _scheme(name, group, config.get("format")))
            for name, group in groups.items()
        ]
        self.ignore: list[str] = config.get("ignore") or []
        if not isinstance(self.ignore, list) or not all(isinstance(n, str) for n in self.ignore):
            raise ValueError(f"ignore: {self.ignore!r} (allowed: a list of module names or re: expressions)")

    def _group_of(self, module: str) -> ConfigGroup | None:
        """The group that takes checkpoint module ``module`` (None: ignored or untargeted)."""
        if any(target_rank(pattern, module) in (0, 1) for pattern in self.ignore):
            return None
        ranked = [(rank, index) for index, group in enumerate(self.groups) for target in group.targets
                  if (rank := target_rank(target, module)) is not None]  # fmt: skip
        return self.groups[min(ranked)[1]] if ranked else None

    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        # Experts are targeted one projection at a time: ask for the first expert's gate.
        modules = [f"{p}.0.gate_proj" if layer.kind is LayerKind.FUSED_MOE else p for p in layer.checkpoint_prefixes]
        groups = {m: self._group_of(m) for m in modules}
        if len({id(g) for g in groups.values()}) > 1:
            raise ValueError(f"{layer.prefix}: its checkpoint modules fall in different config groups or are partly "
                             f"ignored ({', '.join(f'{m}: {g.name if g else None}' for m, g in groups.items())}); "
                             "kvloom runs them as one GEMM")  # fmt: skip
        group = next(iter(groups.values()))
        return None if group is None else _layer_method(layer, group.scheme)

    def describe(self) -> str:
        return "compressed-tensors: " + "; ".join(f"{g.name} ({', '.join(g.targets)}): {g.scheme.describe()}"
                                                  for g in self.groups)  # fmt: skip
