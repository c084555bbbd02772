"""Which quantization method runs a checkpoint: from its ``quantization_config`` or ``--quantization``.

The rules (``resolve_quantization``), with the installed methods (the plugins of
``kvloom.quantization_methods``, by ``NAME``):

1. A checkpoint whose ``config.json`` has a ``quantization_config`` runs with the installed
   method that claims its ``quant_method`` (``QuantizationMethod.checkpoint_formats``);
   ``--quantization NAME`` may name that method (or pick among several that claim it) and
   nothing else. No installed method claims it: an error naming the package to install
   when kvloom has one (``FIRST_PARTY_METHODS``), else saying that kvloom cannot run it yet.
2. A GGUF file runs with an installed method that claims ``"gguf"``; without one, or with
   ``--quantization none``, its weights are dequantized at load (``kvloom.loader.gguf_loader``).
3. An unquantized checkpoint runs unquantized, or, with ``--quantization NAME``, quantized
   while loading by the online method ``NAME``.
4. ``--quantization none`` runs weights as stored, unquantized (refused for a checkpoint
   whose weights are stored quantized; a GGUF file is dequantized).

The chosen method is built from the checkpoint's config and validated against the
platform; its reasons, if any, are the error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the contract imports torch; `--help` reads the form checks here without it
    from kvloom.quantization.method import QuantizationMethod, QuantizationSelectorConfig

logger = logging.getLogger(__name__)

#: ``--quantization none``: the weights as stored (a GGUF file dequantized).
NO_QUANTIZATION = "none"

#: The checkpoint format of GGUF files (a method claims it in ``checkpoint_formats``).
GGUF_FORMAT = "gguf"

#: vLLM's ``--quantization`` choices, so that a vLLM user's value is answered as "not
#: supported yet" rather than as unknown.
VLLM_QUANTIZATION_METHODS: tuple[str, ...] = (
    "aqlm", "awq", "awq_marlin", "bitblas", "bitsandbytes", "compressed-tensors", "deepspeedfp", "experts_int8",
    "fbgemm_fp8", "fp8", "gguf", "gptq", "gptq_bitblas", "gptq_marlin", "gptq_marlin_24", "hqq", "inc", "ipex",
    "marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "neuron_quant", "ptpc_fp8", "qqq", "quark",
    "rtn", "torchao", "tpu_int8", "auto-round",
)  # fmt: skip

#: Checkpoint formats (``quant_method`` values) that a first-party distribution reads,
#: with that distribution: what an error tells the user to ``pip install``.
FIRST_PARTY_METHODS: dict[str, str] = {
    "fp8": "kvloom-quant-fp8",
    "compressed-tensors": "kvloom-quant-compressed-tensors",
}


def check_requested_quantization(method: str | None) -> str | None:
    """The ``--quantization`` value, checked for form only (``EngineArgs`` has no plugins
    loaded yet; ``resolve_quantization`` checks it against the installed methods)."""
    if method is None:
        return None
    if not isinstance(method, str) or not method.strip():
        raise ValueError(f"quantization must be a method name or {NO_QUANTIZATION!r}, got {method!r}")
    return method.strip()


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (of the config or its
    ``text_config``), or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        quant = getattr(config, "quantization_config", None) if config is not None else None
        if quant is None:
            continue
        if not isinstance(quant, dict):
            if not hasattr(quant, "to_dict"):
                raise ValueError(f"quantization_config must be an object (a JSON dict), got {type(quant).__name__}")
            quant = quant.to_dict()
        return dict(quant)
    return None


def quantization_method(hf_config: Any) -> str | None:
    """The ``quant_method`` of the checkpoint's ``quantization_config`` (a dict or a
    transformers config object), ``"unknown"`` when it names none, None without one."""
    quant = checkpoint_quantization_config(hf_config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method) if method else "unknown"


def _installed(methods: Mapping[str, type[QuantizationMethod]]) -> str:
    return ", ".join(sorted(methods)) or "none"


def _not_installed(name: str, methods: Mapping[str, type[QuantizationMethod]], excluded: set[str], what: str) -> str:
    """Why no installed method is ``name``: excluded by KVLOOM_PLUGINS, a package to
    install, a vLLM method kvloom has no plugin for yet, or no method at all."""
    installed = f"installed quantization methods: {_installed(methods)}"
    if name in excluded:
        return f"{what} {name!r} is installed but KVLOOM_PLUGINS does not list it ({installed})"
    if name in FIRST_PARTY_METHODS:
        return f"{what} {name!r} needs the package {FIRST_PARTY_METHODS[name]} (pip install " \
               f"{FIRST_PARTY_METHODS[name]}; {installed})"  # fmt: skip
    if name in VLLM_QUANTIZATION_METHODS:
        return f"{what} {name!r} is not supported by kvloom yet ({installed})"
    return f"{what} {name!r} is not a quantization method kvloom knows ({installed}; or {NO_QUANTIZATION!r})"


def _claiming(fmt: str, methods: Mapping[str, type[QuantizationMethod]]) -> list[str]:
    return sorted(name for name, cls in methods.items() if fmt in cls.checkpoint_formats)


def choose_method(
    checkpoint_format: str | None,
    requested: str | None,
    methods: Mapping[str, type[QuantizationMethod]],
    excluded: set[str] = frozenset(),  # type: ignore[assignment]
    model: str = "",
) -> type[QuantizationMethod] | None:
    """The method class for a checkpoint of ``checkpoint_format`` (its ``quant_method``,
    ``"gguf"`` for a GGUF file, ``None`` for an unquantized one) and the user's
    ``--quantization`` (``requested``), or None to run the weights as stored (see the
    module docstring). A ``ValueError`` names the field and the allowed values."""
    where = f"model {model}: " if model else ""
    if requested == NO_QUANTIZATION:
        if checkpoint_format not in (None, GGUF_FORMAT):
            raise ValueError(f"{where}quantization: {NO_QUANTIZATION!r} cannot run a checkpoint whose weights are "
                             f"stored quantized with {checkpoint_format!r} (config.json's quantization_config); "
                             f"allowed: {', '.join(_claiming(checkpoint_format, methods)) or 'no --quantization'}"
                             )  # fmt: skip
        return None
    if checkpoint_format is None:
        if requested is None:
            return None
        cls = methods.get(requested)
        if cls is None:
            raise ValueError(f"{where}quantization: " + _not_installed(requested, methods, excluded, "method"))
        if not cls.online:
            raise ValueError(f"{where}quantization: {requested!r} reads checkpoints quantized as "
                             f"{', '.join(cls.checkpoint_formats) or 'its format'}; this checkpoint is not quantized "
                             f"(allowed: {', '.join(n for n, c in sorted(methods.items()) if c.online) or 'none'}, "
                             f"or no --quantization)")  # fmt: skip
        return cls
    claiming = _claiming(checkpoint_format, methods)
    if requested is not None:
        if requested in claiming:
            return methods[requested]
        raise ValueError(f"{where}quantization: the checkpoint is quantized with {checkpoint_format!r}, which "
                         f"{requested!r} does not read (allowed: {', '.join(claiming) or 'none installed'}, or no "
                         "--quantization)")  # fmt: skip
    if checkpoint_format == GGUF_FORMAT and not claiming:
        return None  # dequantized at load, as before any GGUF method existed
    if not claiming:
        raise ValueError(f"{where}the checkpoint is quantized with {checkpoint_format!r} (config.json's "
                         f"quantization_config), but no installed quantization method reads it: "
                         + _not_installed(checkpoint_format, methods, excluded, "format"))  # fmt: skip
    if len(claiming) > 1:
        raise ValueError(f"{where}quantization: several installed methods read {checkpoint_format!r} checkpoints "
                         f"({', '.join(claiming)}); choose one with --quantization")  # fmt: skip
    return methods[claiming[0]]


def resolve_quantization(
    hf_config: Any,
    requested: str | None,
    selector: QuantizationSelectorConfig,
    methods: Mapping[str, type[QuantizationMethod]],
    *,
    excluded: set[str] = frozenset(),  # type: ignore[assignment]
    gguf: bool = False,
    model: str = "",
) -> QuantizationMethod | None:
    """The quantization method that runs ``hf_config``'s checkpoint (a GGUF file when
    ``gguf``), built from its ``quantization_config`` and valid on ``selector``'s platform;
    None: the weights run as stored. Every refusal is a ``ValueError`` naming the method."""
    quant_config = None if gguf else checkpoint_quantization_config(hf_config)
    checkpoint_format = GGUF_FORMAT if gguf else quantization_method(hf_config)
    cls = choose_method(checkpoint_format, requested, methods, excluded, model)
    if cls is None:
        return None
    try:
        method = cls(quant_config)
    except ValueError as exc:
        raise ValueError(f"quantization {cls.NAME!r}: the checkpoint's quantization_config: {exc}") from None
    reasons = method.validate(selector)
    if reasons:
        raise ValueError(f"quantization {cls.NAME!r} cannot run this checkpoint on the {selector.device_type} "
                         f"platform: {'; '.join(reasons)}")  # fmt: skip
    logger.info("Quantization: %s", method.describe())
    return method


def quantization_for_engine(
    hf_config: Any,
    requested: str | None,
    platform: Any,
    dtype: Any,
    *,
    tensor_parallel_size: int = 1,
    gguf: bool = False,
    model: str = "",
) -> QuantizationMethod | None:
    """``resolve_quantization`` with the installed methods (``kvloom.plugins``) and the
    active ``platform`` (a ``Platform`` class): what ``create_engine_config`` calls."""
    from kvloom import plugins
    from kvloom.quantization.method import QuantizationSelectorConfig

    selector = QuantizationSelectorConfig(
        device_type=platform.device_type, dtype=dtype, device_capability=platform.get_device_capability(),
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip
    return resolve_quantization(
        hf_config, requested, selector, plugins.quantization_methods(),
        excluded={e.name for e in plugins.excluded(plugins.QUANTIZATION_METHODS)}, gguf=gguf, model=model,
    )  # fmt: skip
