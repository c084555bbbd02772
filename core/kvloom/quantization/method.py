"""The quantization-method contract: what a method declares, and how it is validated.

A quantization method is a plugin (entry-point group ``kvloom.quantization_methods``,
entry-point name == the method's ``NAME``): a ``QuantizationMethod`` subclass, built once
per engine from the checkpoint's ``quantization_config`` (or, for ``--quantization NAME``
of an unquantized checkpoint, from nothing: online quantization). It tells the engine:

1. What it reads and runs, as class attributes: the checkpoint formats
   (``checkpoint_formats``: ``quant_method`` values and their sub-formats), the layer kinds
   it quantizes (``layer_kinds``), the model dtypes it computes in, its weight dtype, the
   device types and compute capabilities it serves, the Python modules its kernels need.
   ``validate`` turns them into human-readable reasons, as attention backends do.
2. For each layer of the model, at construction, the object that owns that layer's
   quantized weights (``layer_method``; ``kvloom.quantization.layer_methods``): it creates
   the parameters, loads the checkpoint tensors into them, repacks them once after
   loading, computes the forward and gives the dequantized reference weight. ``None``
   keeps a layer unquantized (an ignored module, a layer kind the method does not quantize).

``docs/quantization.md`` has the whole contract, with how each kind of method (fp8, int4,
MXFP4, GGUF, ...) plugs in.
"""

from __future__ import annotations

import enum
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvloom.platforms.interface import DeviceCapability

if TYPE_CHECKING:
    from kvloom.quantization.layer_methods import LayerQuantMethod


class LayerKind(str, enum.Enum):
    """The kinds of layer whose weights a method may quantize."""

    LINEAR = "linear"
    """``kvloom.layers.linear``: ``Linear``, ``MergedLinear``, ``QKVLinear`` (replicated,
    column- or row-parallel); a ``LinearQuantMethod`` serves it."""
    FUSED_MOE = "fused_moe"
    """``kvloom.layers.fused_moe.FusedMoE``, the stacked experts of an MoE layer; a
    ``FusedMoEQuantMethod`` serves it."""
    EMBEDDING = "embedding"
    """``kvloom.layers.vocab_embedding.VocabEmbedding``, the token lookup; an
    ``EmbeddingQuantMethod`` serves it."""
    LM_HEAD = "lm_head"
    """``kvloom.layers.vocab_embedding.LMHead``, the logits GEMM (tied to the embedding
    or not); an ``EmbeddingQuantMethod`` serves it."""


@dataclass(frozen=True)
class LayerInfo:
    """What a method learns about one layer when the model builds it (``layer_method``)."""

    kind: LayerKind
    """The layer's kind."""
    prefix: str
    """The layer's module name in kvloom's model (``model.layers.0.self_attn.qkv_proj``)."""
    checkpoint_prefixes: tuple[str, ...]
    """The checkpoint module names whose tensors the layer loads, one per shard of a merged
    layer (``...q_proj``, ``...k_proj``, ``...v_proj``), else ``(prefix,)`` (a ``FusedMoE``:
    the experts' parent, ``model.layers.3.mlp.experts``). Ignore lists and targets of a
    checkpoint's config name these."""
    input_size: int
    """The checkpoint's (whole) input features; for embeddings the embedding dim."""
    output_sizes: tuple[int, ...]
    """The checkpoint's (whole) output features of each shard; for embeddings
    ``(num_embeddings,)``; for a ``FusedMoE`` ``(intermediate_size,)`` of one expert."""
    tp_size: int = 1
    """The tensor-parallel ranks this layer is split over (1: not split)."""
    num_experts: int = 0
    """A ``FusedMoE``'s experts (0 for other kinds)."""

    def ignored_by(self, names: Sequence[str]) -> bool:
        """Whether a checkpoint's list of unquantized modules (``ignored_layers``,
        ``modules_to_not_convert``) keeps this layer unquantized: each of its checkpoint
        modules is named by the list (the same name, a parent of it, or its last parts:
        ``lm_head``, ``mlp.gate``). A merged layer whose shards disagree cannot run (one
        GEMM, one format): a ``ValueError`` naming them."""
        flags = [any(p == n or p.startswith(n + ".") or p.endswith("." + n) for n in names)
                 for p in self.checkpoint_prefixes]  # fmt: skip
        if any(flags) and not all(flags):
            kept = [p for p, flag in zip(self.checkpoint_prefixes, flags) if not flag]
            raise ValueError(f"{self.prefix}: the checkpoint keeps some of its merged modules unquantized and "
                             f"quantizes others ({', '.join(kept)}); kvloom runs them as one GEMM")  # fmt: skip
        return all(flags)


@dataclass(frozen=True)
class QuantizationSelectorConfig:
    """What ``QuantizationMethod.validate`` checks a method against: the run's platform,
    dtype and parallelism."""

    device_type: str
    """The active platform's torch device type ("cpu", "cuda", ...)."""
    dtype: torch.dtype
    """The model dtype (of activations and of unquantized weights)."""
    device_capability: DeviceCapability | None = None
    """The device's compute capability (CUDA-like devices), else ``None``."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks."""


_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class QuantizationMethod(ABC):
    """A quantization method: its declarations, its checkpoint config, its layers.

    Subclasses set the class attributes, parse the checkpoint's ``quantization_config`` in
    ``__init__`` (a ``ValueError`` naming the field and the allowed values for anything
    they do not run) and implement ``layer_method``. ``validate`` has a complete default
    built from the declarations; override ``extra_validation`` for checks they cannot
    express (e.g. a kernel's block size on one device type).
    """

    NAME: ClassVar[str]
    """The method's unique name: its entry-point name and what ``--quantization`` takes."""
    checkpoint_formats: ClassVar[dict[str, tuple[str, ...]]] = {}
    """The checkpoints it reads: ``quantization_config["quant_method"]`` value -> the
    sub-formats of that format it reads (compressed-tensors' ``format``:
    ``{"compressed-tensors": ("float-quantized",)}``; ``()`` for a format without
    sub-formats, ``{"fp8": ()}``). ``"gguf"`` claims GGUF files (which have no
    ``quantization_config``)."""
    online: ClassVar[bool] = False
    """Whether it quantizes an unquantized checkpoint while loading (``--quantization NAME``
    of a float16/bfloat16/float32 checkpoint); ``__init__`` then receives ``None``."""
    layer_kinds: ClassVar[tuple[LayerKind, ...]] = (LayerKind.LINEAR,)
    """The layer kinds it can quantize (``layer_method`` returns ``None`` for the others)."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    """Model (activation) dtypes it computes in."""
    weight_dtype: ClassVar[str] = ""
    """What its weights are stored as, in words ("float8_e4m3fn", "int4 (group 128)")."""
    activation_dtype: ClassVar[str] = ""
    """What its kernels take as activations, in words ("float8_e4m3fn, dynamic per token";
    "" = the model dtype, weight-only)."""
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    """torch device types it runs on."""
    min_compute_capability: ClassVar[DeviceCapability | None] = None
    """Lowest compute capability served on CUDA-like devices, inclusive; ``None``: any."""
    supports_tensor_parallel: ClassVar[bool] = True
    """Whether its layers load and run split over tensor-parallel ranks."""
    required_modules: ClassVar[dict[str, str]] = {}
    """Python modules its kernels import, with the pip distribution providing each; a
    missing one is a reason, not a crash."""

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        """``quantization_config``: the checkpoint's (``config.json``), or ``None`` for online
        quantization. Subclasses parse it and raise ``ValueError`` for what they do not run."""
        if quantization_config is None and not self.online:
            raise ValueError(f"quantization {self.NAME!r} reads quantized checkpoints only; this checkpoint has no "
                             "quantization_config (serve it without --quantization)")  # fmt: skip
        self.quantization_config: dict[str, Any] = dict(quantization_config or {})

    @abstractmethod
    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        """The object that owns ``layer``'s quantized weights (a ``LinearQuantMethod`` for
        ``LayerKind.LINEAR``, ...), or ``None`` to keep the layer unquantized (a module the
        checkpoint's ignore list names, a kind the method does not quantize). Called once
        per layer while the model is built."""

    def describe(self) -> str:
        """One line for the startup log: the method and what this checkpoint uses of it."""
        return self.NAME

    # ------------------------------------------------------------------ validation
    @classmethod
    def missing_modules(cls) -> list[str]:
        """A reason for each required module that cannot be imported."""
        return [
            f"{module} is not installed (pip install {dist})"
            for module, dist in cls.required_modules.items()
            if importlib.util.find_spec(module) is None
        ]

    def validate(self, config: QuantizationSelectorConfig) -> list[str]:
        """Every reason this method cannot run this checkpoint on ``config``'s platform;
        empty means it can."""
        cls = type(self)
        reasons: list[str] = []
        if config.device_type not in cls.supported_device_types:
            reasons.append(f"device type {config.device_type} not supported "
                           f"(supports {', '.join(cls.supported_device_types)})")  # fmt: skip
        if config.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {_dtype_name(config.dtype)} not supported "
                           f"(supports {', '.join(_dtype_name(d) for d in cls.supported_dtypes)})")  # fmt: skip
        cap, lo = config.device_capability, cls.min_compute_capability
        if cap is not None and lo is not None and config.device_type == "cuda" and cap < lo:
            reasons.append(f"compute capability {cap} not supported (needs {lo} or newer)")
        if config.tensor_parallel_size > 1 and not cls.supports_tensor_parallel:
            reasons.append(f"tensor parallelism not supported (tensor_parallel_size {config.tensor_parallel_size}; "
                           "supports 1)")  # fmt: skip
        reasons.extend(cls.missing_modules())
        reasons.extend(self.extra_validation(config))
        return reasons

    def extra_validation(self, config: QuantizationSelectorConfig) -> list[str]:
        """Method-specific reasons beyond the declarations. Default: none."""
        return []

    @classmethod
    def support_summary(cls) -> dict[str, Any]:
        """The declarations as plain data (``kvloom quantization list``, docs tables)."""
        return {
            "checkpoint_formats": {k: list(v) for k, v in cls.checkpoint_formats.items()},
            "online": cls.online,
            "layer_kinds": [k.value for k in cls.layer_kinds],
            "dtypes": [_dtype_name(d) for d in cls.supported_dtypes],
            "weight_dtype": cls.weight_dtype,
            "activation_dtype": cls.activation_dtype or "model dtype",
            "device_types": list(cls.supported_device_types),
            "min_compute_capability": str(cls.min_compute_capability) if cls.min_compute_capability else None,
            "tensor_parallel": cls.supports_tensor_parallel,
        }
