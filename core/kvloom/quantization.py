"""Quantized checkpoints: which kvloom runs (none yet), and the refusal of the others.

kvloom runs unquantized weights (and GGUF files, which it dequantizes at load). A
checkpoint whose ``config.json`` has a ``quantization_config`` (fp8, GPTQ, AWQ,
bitsandbytes, compressed-tensors, ...) is refused at load, naming the method: loading
its tensors as if they were plain weights would generate wrong tokens in silence. The
``--quantization`` flag (``EngineArgs.quantization``) is refused the same way for every
method but ``None``.
"""

from __future__ import annotations

from typing import Any

#: vLLM's ``--quantization`` choices, so that a vLLM user's value is refused as "not
#: supported yet" rather than as unknown.
VLLM_QUANTIZATION_METHODS: tuple[str, ...] = (
    "aqlm", "awq", "awq_marlin", "bitblas", "bitsandbytes", "compressed-tensors", "deepspeedfp", "experts_int8",
    "fbgemm_fp8", "fp8", "gguf", "gptq", "gptq_bitblas", "gptq_marlin", "gptq_marlin_24", "hqq", "inc", "ipex",
    "marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "neuron_quant", "ptpc_fp8", "qqq", "quark",
    "rtn", "torchao", "tpu_int8", "auto-round",
)  # fmt: skip

#: Quantization methods kvloom runs (``--quantization`` values besides None).
SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = ()


def check_requested_quantization(method: str | None) -> str | None:
    """``method`` if kvloom runs it (only None so far), else a ``ValueError`` that says
    it is not supported yet (or not a quantization method at all)."""
    if method is None or method in SUPPORTED_QUANTIZATION_METHODS:
        return method
    if method in VLLM_QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {method!r} is not supported by kvloom yet (kvloom runs unquantized checkpoints, and "
            "GGUF files dequantized without this flag; allowed: no --quantization)"
        )
    raise ValueError(
        f"{method!r} is not a quantization method (vLLM's: {', '.join(VLLM_QUANTIZATION_METHODS)}); kvloom "
        "supports none yet (allowed: no --quantization)"
    )


def quantization_method(hf_config: Any) -> str | None:
    """The ``quant_method`` of the checkpoint's ``quantization_config`` (a dict or a
    transformers config object), ``"unknown"`` when it names none, None without one."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        quant = getattr(config, "quantization_config", None) if config is not None else None
        if quant is None:
            continue
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
        return str(method) if method else "unknown"
    return None


def check_checkpoint_quantization(hf_config: Any, model: str) -> None:
    """Refuse a quantized checkpoint (its config's ``quantization_config``), naming the method."""
    method = quantization_method(hf_config)
    if method is None or method in SUPPORTED_QUANTIZATION_METHODS:
        return
    raise ValueError(
        f"model {model}: the checkpoint is quantized with {method!r} (config.json's quantization_config), which "
        "kvloom does not support yet; serve an unquantized (float16/bfloat16/float32) checkpoint or a GGUF file"
    )
