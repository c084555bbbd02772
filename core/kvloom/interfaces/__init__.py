"""kvloom's public plugin API: everything a plugin imports from kvloom, in one place.

Plugins import from here (and model authors also from ``kvloom.interfaces.models``);
every other kvloom module is private and may change without notice. A plugin's tests
also use ``kvloom`` itself (the user API: ``LLM``, ``SamplingParams``, ``EngineArgs``,
...) and ``kvloom.testing`` (the conformance suite, the float64 and custom-op references,
helpers to resolve an engine config, make a backend class look installed, run the CLI
in-process; tiny checkpoints, LoRA adapters and pip-install helpers in its
``models``, ``lora`` and ``install`` modules).
``tests/test_plugin_face.py`` keeps the first-party plugins and their tests to this rule.
What each name is for, by plugin kind (``docs/plugins.md`` has the whole contracts, with
example packages):

- attention backends: ``AttentionBackend`` (declarations and selection),
  ``AttentionImpl`` (one layer's forward), ``AttentionMetadataBuilder`` (per-step
  metadata), ``CommonAttentionMetadata``, ``AttentionLayerSpec``,
  ``AttentionSelectorConfig``, ``AttentionType``, ``AttentionCGSupport``, ``MultipleOf``,
  ``BlockSizeSpec``; ``window_start`` (the first position a query sees in a sliding window);
  KV writes for backends without a write kernel: ``write_kv_default_layout``,
  ``copy_rows_skipping_invalid``; an fp8 KV cache (``AttentionImpl.k_scale`` / ``v_scale``):
  ``FP8_KV_CACHE_DTYPES``, ``is_fp8_kv_cache``, ``quantize_kv``, ``dequantize_kv``,
  ``inverse_kv_scale`` (what a write kernel multiplies by); environment overrides of a kernel configuration
  dataclass (``NAME=INT,...``): ``parse_kernel_overrides``, with the range checks of its
  fields (``check_launch_fields``), its resolution (``resolve_kernel_config``),
  ``next_power_of_2`` and ``cdiv`` (ceiling division, for grids), ``k_splits`` (a split-K plan that
  fills the GPU); the shortest run a split-KV
  decode kernel may give a split (so CUDA graphs and eager steps agree): ``min_split_tiles``;
- platforms: ``Platform``, ``BackendCandidate``, ``DeviceCapability``; the tensor-parallel
  all-reduce a platform may supply (``Platform.make_tp_communicator``): ``TPCommunicator``
  and the ``KVLOOM_ALLREDUCE`` switch, ``allreduce_mode``; workers:
  ``WorkerBase`` (the contract) and ``Worker`` (kvloom's generic torch worker, to
  subclass), which drives the model runner it is handed through the methods of
  ``ModelRunnerProtocol`` (``self.runner``: a platform's worker calls its
  ``profile_peak_memory`` to size the KV cache and ``capture_cudagraphs``);
  ``EngineConfig`` (what ``check_and_update_config`` adjusts) and its sections
  ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``,
  ``AttentionConfig``, ``LoadConfig``, ``CompilationConfig``, ``LoRAConfig``,
  ``ObservabilityConfig``, ``DeviceConfig`` (each field documented, with what platforms
  and hooks may change), ``CUDAGraphMode``, ``effective_decode_graphs``; the custom layer ops a platform may
  replace: ``CUSTOM_OP_SIGNATURES`` (the torch code of each: ``custom_op_reference``, for
  inputs an op does not take), and ``LoRAMapping`` for the ``lora_delta`` op;
- general plugins: ``hookimpl`` and the registries the hooks receive
  (``ModelRegistry``, ``LoRAResolverRegistry``);
- structured-output backends: ``StructuredOutputBackend``, ``StructuredOutputGrammar``,
  ``StructuredOutputsParams``; tool-call parsers: ``ToolParser``, ``ExtractedToolCalls``,
  ``ParsedToolCall`` (``docs/structured_outputs.md``); reasoning parsers:
  ``ReasoningParser``, ``ReasoningState``, ``ReasoningStream``, ``ReasoningDelta``;
- logits processors: ``LogitsProcessor``, ``LogitsProcessorRow``; endpoint plugins:
  ``EndpointPlugin`` (handlers raise ``APIError`` for a client's mistake);
- IO processors: ``IOProcessor``, ``PromptType``, ``PoolingParams``, ``SamplingParams``,
  ``PoolingRequestOutput``;
- stat loggers: ``StatLoggerBase`` and the stats it records: ``SchedulerStats``,
  ``PrefixCacheStats``, ``IterationStats``, ``FinishedRequestStats``;
- LoRA resolvers: ``LoRAResolver``, ``LoRARequest``, ``read_adapter_config``,
  ``validate_adapter_config``, ``LoRAAdapterError`` (the ``ValueError`` those two raise),
  ``ADAPTER_CONFIG_FILE``;
- quantization methods (``docs/quantization.md``): ``QuantizationMethod`` (declarations,
  ``validate``, ``layer_method``), ``QuantizationSelectorConfig``, ``LayerKind``,
  ``LayerInfo``; per layer ``LayerQuantMethod`` and its kinds ``LinearQuantMethod``,
  ``FusedMoEQuantMethod``, ``EmbeddingQuantMethod``; parameters that follow the weight:
  ``ParamLayout``, ``add_quantized_parameter``, ``remove_quantized_parameter``; the torch
  code of the experts for a method's own weights: ``fused_moe_torch`` (a lazy checkpoint
  tensor ``load_weight`` gets is read with ``kvloom.interfaces.models.materialize``); a GGUF
  file's tensors as stored, for a method claiming ``"gguf"``: ``GGUFTensor``; the on-disk cache
  root for what a method derives once (repacked weights, built kernels): ``kvloom_cache_dir``;
  C kernels of CPU plugins, built once per machine and loaded with ctypes: ``load_c_library``
  (``c_build_problem`` says why they cannot be built here, ``cpu_simd`` which vector code they get,
  ``prepare_c_library`` starts a build in the background, ``try_load_c_library`` loads or warns and
  returns None).
- speculative-decoding proposers (``docs/speculative_decoding.md``): ``SpecDecodeProposer``
  (declarations, ``validate``) and its kinds ``HostProposer`` (drafts from token ids:
  ``ProposalRequest`` in, ``Proposals`` out) and ``ModelProposer`` (a ``DraftModel`` built
  from a ``DraftModelContext``); the user's ``SpeculativeConfig``.
- KV connectors (``docs/kv_connectors.md``): ``KVConnectorBase`` (both sides of the contract),
  ``KVConnectorRole``, ``KVConnectorMetadata``, ``KVConnectorRequest``,
  ``KVConnectorStep``, ``ScheduledKVRequest``, ``KVConnectorOutput``, ``KVCacheGroupSpec``,
  ``KVTransferConfig``, the counts they report (``KVTransferStats``, ``KVTransferCounts``);
  moving blocks: ``KVLayerCache``, ``block_key``, ``KVBlockFiles``, ``KVBlockFileError``,
  ``kv_layout_fingerprint``, ``kv_cache_bytes_per_block``, ``device_label``; sizing a
  host-memory store: ``available_host_memory`` (also what the CPU platform sizes its KV
  cache by).

``PLUGIN_API_VERSION`` is the plugin API this kvloom provides. A plugin module does not
import it (``from kvloom.interfaces import *`` does not define ``KVLOOM_PLUGIN_API``): it
declares the version it was written for, as a literal of its own::

    KVLOOM_PLUGIN_API = "1.1"

kvloom refuses a plugin whose major version differs, or whose minor version is newer than
kvloom's, with a message naming both (``docs/plugins.md``, "Compatibility").
"""

from typing import TYPE_CHECKING

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    AttentionType,
    BlockSizeSpec,
    CommonAttentionMetadata,
    MultipleOf,
    effective_decode_graphs,
    window_start,
)
from kvloom.attention.kernel_overrides import (
    check_launch_fields,
    k_splits,
    next_power_of_2,
    parse_kernel_overrides,
    resolve_kernel_config,
)
from kvloom.attention.kv_quant import (
    FP8_KV_CACHE_DTYPES,
    dequantize_kv,
    inverse_kv_scale,
    is_fp8_kv_cache,
    quantize_kv,
)
from kvloom.attention.kv_write import copy_rows_skipping_invalid, write_kv_default_layout
from kvloom.attention.mla_backend import (
    MLA_DECODE,
    MLA_PREFILL,
    MLAAttentionBackend,
    MLAAttentionImpl,
    MLADims,
    split_latent_cache,
    write_latent_torch,
)
from kvloom.attention.split_kv import min_split_tiles
from kvloom.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.deprecation import Deprecation, deprecated_attributes
from kvloom.distributed.communicator import TPCommunicator, allreduce_mode
from kvloom.entrypoint_plugin import EndpointPlugin
from kvloom.entrypoints.openai.errors import APIError
from kvloom.hookspecs import hookimpl
from kvloom.inputs import PromptType
from kvloom.io_processor import IOProcessor
from kvloom.kv_transfer.base import (
    KVCacheGroupSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRequest,
    KVConnectorRole,
    KVConnectorStep,
    ScheduledKVRequest,
)
from kvloom.kv_transfer.blocks import (
    KVBlockFileError,
    KVBlockFiles,
    KVLayerCache,
    block_key,
    device_label,
    kv_cache_bytes_per_block,
    kv_layout_fingerprint,
)
from kvloom.kv_transfer.config import KVTransferConfig
from kvloom.layers.custom_op_reference import custom_op_reference
from kvloom.layers.custom_ops import OP_SIGNATURES as CUSTOM_OP_SIGNATURES
from kvloom.layers.fused_moe import fused_moe_torch
from kvloom.loader.gguf_file import GGUFTensor
from kvloom.logits_processor import LogitsProcessor, LogitsProcessorRow
from kvloom.lora.adapter import CONFIG_FILE as ADAPTER_CONFIG_FILE
from kvloom.lora.adapter import LoRAAdapterError, read_adapter_config, validate_adapter_config
from kvloom.lora.ops import LoRAMapping
from kvloom.lora.request import LoRARequest
from kvloom.lora.resolver import LoRAResolver, LoRAResolverRegistry
from kvloom.metrics.scheduler_stats import KVTransferCounts, KVTransferStats, PrefixCacheStats, SchedulerStats
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.metrics.stats import FinishedRequestStats, IterationStats
from kvloom.models.registry import ModelRegistry
from kvloom.native import c_build_problem, cpu_simd, load_c_library, prepare_c_library, try_load_c_library
from kvloom.outputs import PoolingRequestOutput
from kvloom.platforms.interface import BackendCandidate, DeviceCapability, Platform
from kvloom.platforms.worker import ModelRunnerProtocol, Worker, WorkerBase
from kvloom.plugins import PLUGIN_API_VERSION
from kvloom.quantization.layer_methods import (
    EmbeddingQuantMethod,
    FusedMoEQuantMethod,
    LayerQuantMethod,
    LinearQuantMethod,
    ParamLayout,
    add_quantized_parameter,
    remove_quantized_parameter,
)
from kvloom.quantization.method import LayerInfo, LayerKind, QuantizationMethod, QuantizationSelectorConfig
from kvloom.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningState, ReasoningStream
from kvloom.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams
from kvloom.spec_decode.proposer import (
    DraftModel,
    DraftModelContext,
    HostProposer,
    ModelProposer,
    ProposalRequest,
    Proposals,
    SpecDecodeProposer,
)
from kvloom.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvloom.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser
from kvloom.utils import available_host_memory, cdiv, kvloom_cache_dir

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "FP8_KV_CACHE_DTYPES",
    "APIError",
    "MLA_DECODE",
    "MLA_PREFILL",
    "MLAAttentionBackend",
    "MLAAttentionImpl",
    "MLADims",
    "split_latent_cache",
    "write_latent_torch",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionLayerSpec",
    "AttentionMetadataBuilder",
    "AttentionSelectorConfig",
    "AttentionType",
    "BackendCandidate",
    "BlockSizeSpec",
    "CUDAGraphMode",
    "CUSTOM_OP_SIGNATURES",
    "custom_op_reference",
    "CacheConfig",
    "CommonAttentionMetadata",
    "CompilationConfig",
    "DeviceCapability",
    "DeviceConfig",
    "EndpointPlugin",
    "EngineConfig",
    "ExtractedToolCalls",
    "FinishedRequestStats",
    "IOProcessor",
    "IterationStats",
    "LoRAAdapterError",
    "LoRAConfig",
    "LogitsProcessor",
    "LogitsProcessorRow",
    "LoRAMapping",
    "LoRARequest",
    "LoRAResolver",
    "LoRAResolverRegistry",
    "LoadConfig",
    "ModelConfig",
    "ModelRegistry",
    "ModelRunnerProtocol",
    "MultipleOf",
    "ObservabilityConfig",
    "PLUGIN_API_VERSION",
    "ParallelConfig",
    "ParsedToolCall",
    "Platform",
    "PoolingParams",
    "PoolingRequestOutput",
    "PrefixCacheStats",
    "PromptType",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningState",
    "ReasoningStream",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerStats",
    "StatLoggerBase",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputsParams",
    "TPCommunicator",
    "ToolParser",
    "Worker",
    "WorkerBase",
    "allreduce_mode",
    "check_launch_fields",
    "copy_rows_skipping_invalid",
    "dequantize_kv",
    "inverse_kv_scale",
    "is_fp8_kv_cache",
    "quantize_kv",
    "effective_decode_graphs",
    "window_start",
    "hookimpl",
    "cdiv",
    "min_split_tiles",
    "next_power_of_2",
    "k_splits",
    "parse_kernel_overrides",
    "read_adapter_config",
    "resolve_kernel_config",
    "validate_adapter_config",
    "write_kv_default_layout",
    # quantization methods
    "EmbeddingQuantMethod",
    "FusedMoEQuantMethod",
    "GGUFTensor",
    "LayerInfo",
    "LayerKind",
    "LayerQuantMethod",
    "LinearQuantMethod",
    "ParamLayout",
    "QuantizationMethod",
    "QuantizationSelectorConfig",
    "add_quantized_parameter",
    "fused_moe_torch",
    "kvloom_cache_dir",
    "load_c_library",
    "prepare_c_library",
    "try_load_c_library",
    "c_build_problem",
    "cpu_simd",
    "remove_quantized_parameter",
    # speculative-decoding proposers
    "DraftModel",
    "DraftModelContext",
    "HostProposer",
    "ModelProposer",
    "ProposalRequest",
    "Proposals",
    "SpecDecodeProposer",
    "SpeculativeConfig",
    # KV connectors
    "KVBlockFileError",
    "KVBlockFiles",
    "KVCacheGroupSpec",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRequest",
    "KVConnectorRole",
    "KVConnectorStep",
    "KVLayerCache",
    "KVTransferConfig",
    "KVTransferCounts",
    "KVTransferStats",
    "ScheduledKVRequest",
    "block_key",
    "device_label",
    "kv_cache_bytes_per_block",
    "kv_layout_fingerprint",
    "available_host_memory",
]

# Docstrings of the re-exported values, for the API reference (scripts/build-api-docs.sh):
# pdoc reads a string after an annotated name as that name's docstring. The bare
# annotations below bind nothing; the values are the imports above.

if TYPE_CHECKING:
    import torch
    from pluggy import HookimplMarker

    from kvloom.lora.resolver import _LoRAResolverRegistry
    from kvloom.models.registry import _ModelRegistry

ADAPTER_CONFIG_FILE: str
"""The file name of a PEFT adapter's config inside its directory (``adapter_config.json``)."""

MLA_DECODE: str
"""The MLA decode phase (``"decode"``): an entry of ``MLAAttentionBackend.mla_phases`` and the
``spec.extra["mla_phase"]`` of a builder built for decode requests."""

MLA_PREFILL: str
"""The MLA prefill phase (``"prefill"``): an entry of ``MLAAttentionBackend.mla_phases`` and the
``spec.extra["mla_phase"]`` of a builder built for prefill requests."""

BlockSizeSpec: type
"""One entry of ``AttentionBackend.supported_block_sizes``: an exact ``int`` block size, or
``MultipleOf(n)``."""

FP8_KV_CACHE_DTYPES: "dict[str, torch.dtype]"
"""The ``--kv-cache-dtype`` values of an fp8 KV cache -> its torch dtype: ``fp8`` and
``fp8_e4m3`` (``torch.float8_e4m3fn``), ``fp8_e5m2`` (``torch.float8_e5m2``). A backend
that stores and reads them declares these names in ``supported_kv_cache_dtypes``."""

CUSTOM_OP_SIGNATURES: dict[str, str]
"""The layer ops a platform may replace through ``Platform.custom_ops(config)``: op name ->
the call each layer makes (arguments -> result). A replacement takes the same arguments,
returns new tensors (inputs untouched; ``lora_delta`` may add to ``y`` in place) and
matches the torch code (``kvloom.testing.custom_op_reference(name)``) for the dtypes it is
enabled for: bit-identical for ``silu_and_mul``, ``rotary_qk`` and the residual sum of
``fused_add_rms_norm``; within 2 ulp (float16/bfloat16) or 1e-5 relative (float32) for the
norms; ``lora_delta`` within the dtype's tolerance of ``lora_delta_reference``.
``kvloom.testing.check_custom_op`` checks all of it."""

LoRAResolverRegistry: "_LoRAResolverRegistry"
"""The process's LoRA resolvers, by name, in registration order (what the
``kvloom_register_lora_resolvers`` hook receives): ``register_resolver(name, resolver)``
(a ``LoRAResolver`` instance; a taken name is a ``ValueError``), ``get_supported_resolvers()``,
``get_resolver(name)``."""

ModelRegistry: "_ModelRegistry"
"""Architecture name -> model class (what the ``kvloom_register_models`` hook receives):
``register_model(architecture, model_cls)`` with a class or a lazy ``"module:Class"``
string (re-registering the same target is a no-op; another target overrides, with a
warning), ``is_supported(architecture)``, ``get_supported_archs()``."""

PLUGIN_API_VERSION: str
"""The plugin API this kvloom provides (``"1.1"``). A plugin module declares the version it
was written for as a literal, ``KVLOOM_PLUGIN_API = "1.1"``; a different major version is
refused, and so is a newer minor version (the plugin may use what this kvloom lacks); an older
minor version of the same major loads."""

PromptType: type
"""What a prompt may be: text, ``{"prompt_token_ids": [...]}`` (with an optional
``"prompt"`` text), or ``{"prompt": text}``."""

hookimpl: "HookimplMarker"
"""The decorator that marks a general plugin's hook implementations
(``kvloom_register_models(model_registry)``, ``kvloom_register_lora_resolvers(resolver_registry)``,
``kvloom_update_engine_config(config)``); pluggy checks each against kvloom's specs when it loads."""



def _model_runner_class() -> object:
    from kvloom.worker.model_runner import ModelRunner

    return ModelRunner


# Names that left the face, imported on first use (the face itself imports no engine module).
__getattr__ = deprecated_attributes(__name__, {
    "ModelRunner": (Deprecation("kvloom.interfaces.ModelRunner", "kvloom.interfaces.ModelRunnerProtocol (the methods "
                                "a worker may call; the worker is handed its runner class)", "1.2"), _model_runner_class),
})  # fmt: skip
