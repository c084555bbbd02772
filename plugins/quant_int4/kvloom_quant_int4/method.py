"""The ``awq`` and ``gptq`` methods: checkpoints whose ``quantization_config`` has
``quant_method: awq`` (AutoAWQ, ``version: gemm``) or ``quant_method: gptq`` (AutoGPTQ,
GPTQModel), 4-bit weights with group scales; activations stay in the model dtype (W4A16).

AWQ's config::

    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
     "modules_to_not_convert": [...]}

GPTQ's::

    {"quant_method": "gptq", "bits": 4, "group_size": 128 | -1, "desc_act": false, "sym": true,
     "checkpoint_format": "gptq" | "gptq_v2", "lm_head": false}

What they do not read (other bit widths, AWQ's GEMV / Marlin packings, GPTQ's Marlin
format, a quantized LM head, per-module ``dynamic`` overrides) is a ``ValueError`` naming
the field and the allowed values.
"""

from __future__ import annotations

from typing import Any

import torch

from kvloom.interfaces import LayerInfo, LayerKind, LayerQuantMethod, QuantizationMethod
from kvloom_quant_int4.formats import AwqFormat, GptqFormat, Int4Format
from kvloom_quant_int4.layers import W4LinearMethod, W4MoEMethod


def config_field(config: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The first of ``names`` present in ``config`` (the tools spell some fields two ways)."""
    return next((config[name] for name in names if name in config), default)


def module_names(config: dict[str, Any], field: str) -> list[str]:
    """A config field listing module names (``modules_to_not_convert``); absent: []."""
    names = config.get(field) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{field}: {names!r} (allowed: a list of module names)")
    return names


def check_bits(bits: object) -> None:
    if bits != 4:
        raise ValueError(f"bits: {bits!r} is not supported (allowed: 4)")


def check_group_size(group_size: object, allow_channel: bool) -> int:
    valid = isinstance(group_size, int) and not isinstance(group_size, bool)
    if not valid or not (group_size >= 16 or (allow_channel and group_size == -1)):  # type: ignore[operator]
        allowed = "an int >= 16" + (", or -1 (per channel)" if allow_channel else "")
        raise ValueError(f"group_size: {group_size!r} (allowed: {allowed})")
    return group_size  # type: ignore[return-value]


def w4_layer_method(layer: LayerInfo, fmt: Any) -> LayerQuantMethod | None:
    """The 4-bit method of a linear layer or an expert layer in format ``fmt``."""
    if layer.kind is LayerKind.LINEAR:
        return W4LinearMethod(fmt)
    if layer.kind is LayerKind.FUSED_MOE:
        return W4MoEMethod(fmt)
    return None


class Int4Method(QuantizationMethod):
    """4-bit integer weights with group scales (the shared declarations of AWQ and GPTQ)."""

    layer_kinds = (LayerKind.LINEAR, LayerKind.FUSED_MOE)
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    weight_dtype = "int4 (group scales and zero points)"
    activation_dtype = None
    supported_device_types = ("cpu", "cuda")

    fmt: Int4Format
    ignored: list[str]

    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        if layer.ignored_by(self.ignored):
            return None
        return w4_layer_method(layer, self.fmt)

    def describe(self) -> str:
        ignored = f"; unquantized: {', '.join(self.ignored)}" if self.ignored else ""
        return f"{self.fmt.describe()}; activations in the model dtype{ignored}"


class AwqMethod(Int4Method):
    """AutoAWQ checkpoints (GEMM packing)."""

    NAME = "awq"
    checkpoint_formats = {"awq": ()}

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        config = self.quantization_config
        check_bits(config_field(config, ("bits", "w_bit"), 4))
        group_size = check_group_size(config_field(config, ("group_size", "q_group_size"), 128), allow_channel=False)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"version: {config.get('version')!r} is not supported (allowed: gemm; GEMV and Marlin "
                             "packings store the values in another order)")  # fmt: skip
        if config.get("zero_point", True) is not True:
            raise ValueError(f"zero_point: {config.get('zero_point')!r} is not supported (allowed: true)")
        self.ignored = module_names(config, "modules_to_not_convert")
        self.fmt = AwqFormat(group_size, zero_point=True, act_order=False)


class GptqMethod(Int4Method):
    """AutoGPTQ / GPTQModel checkpoints (act-order included)."""

    NAME = "gptq"
    checkpoint_formats = {"gptq": ()}

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        config = self.quantization_config
        check_bits(config.get("bits", 4))
        group_size = check_group_size(config.get("group_size", 128), allow_channel=True)
        checkpoint_format = config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format: {checkpoint_format!r} is not supported (allowed: gptq, gptq_v2)")
        if config.get("lm_head"):
            raise ValueError("lm_head: true is not supported (allowed: false; kvloom keeps the LM head unquantized)")
        if config.get("dynamic"):
            raise ValueError(f"dynamic: {config['dynamic']!r} is not supported (allowed: none; per-module overrides)")
        for field in ("desc_act", "sym"):
            if not isinstance(config.get(field, False), bool):
                raise ValueError(f"{field}: {config[field]!r} (allowed: true, false)")
        self.ignored = module_names(config, "modules_to_not_convert")
        self.fmt = GptqFormat(group_size, zero_point=not config.get("sym", True),
                              act_order=config.get("desc_act", False), v2=checkpoint_format == "gptq_v2")  # fmt: skip
