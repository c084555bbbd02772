"""``EngineArgs``: the user's flat engine options.

``EngineArgs`` holds the keyword arguments of ``LLM`` and the flags of ``kvloom serve`` /
``generate``, named as vLLM users type them. It is a pydantic model, but its errors are in
kvloom's words: ``EngineArgs(...)`` (and ``LLM(...)``) raise a ``ValueError`` naming each
bad field and its allowed values or range; a vLLM option kvloom has not built says so
("speculative_config is not supported by kvloom yet"), one it ignores is dropped with a
warning (both from the table of vLLM's options, ``entrypoints/cli/vllm_flags.py``), and any
other unknown name is "unknown option X (did you mean Y?)" (``EngineArgsError``; the CLI
names the flags instead: ``entrypoints/cli/engine_args.py``).

``config_builder.create_engine_config(args)`` resolves them into the ``EngineConfig``.
This module imports only what ``EngineArgs`` needs: the CLI builds its flags from it, and
``kvloom --help`` must not pay for importing torch.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.kv_transfer.config import parse_kv_transfer_config
from kvloom.quantization.selection import check_requested_quantization
from kvloom.structured_output.options import (
    check_structured_outputs_config,
    structured_outputs_options,
)

#: --dtype names -> the torch dtype's attribute name (``getattr(torch, ...)``).
DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}

logger = logging.getLogger(__name__)

DTypeName = Literal["auto", "float32", "float", "float16", "half", "bfloat16"]
LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash"]


def parse_memory_size(value: int | str) -> int:
    """Bytes from an int or a string like "4GiB", "512MiB", "2G", "1e9"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a memory size: {value!r} (examples: 4GiB, 512MiB, 1000000000)")
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(number * scale)


class EngineArgsError(ValueError):
    """Invalid ``EngineArgs``: the message names each bad field (by its Python name) and what
    it allows; ``validation_error`` is pydantic's, for a caller that names the fields
    otherwise (the CLI names its flags)."""

    def __init__(self, validation_error: ValidationError) -> None:
        super().__init__(_describe(validation_error))
        self.validation_error = validation_error


class EngineArgs(BaseModel):
    """All user-facing engine options, flat. CLI flags are these names with dashes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise EngineArgsError(exc) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise EngineArgsError(exc) from None

    # ---- model
    model: str | None = Field(
        None, description="HF directory, .gguf file, Hugging Face Hub id (org/name, org/name:Q4_K_M or "
        "org/name/file.gguf), or None for the default SmolLM2."
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory or hub id (default: the model's).")
    revision: str | None = Field(None, description="Hub ids: the model's branch, tag or commit (default: main).")
    tokenizer_revision: str | None = Field(
        None, description="Hub ids: the tokenizer's branch, tag or commit (default: main)."
    )
    download_dir: str | None = Field(
        None, description="Hub ids: the Hugging Face cache folder to read and download into (default: "
        "huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub)."
    )
    skip_tokenizer_init: bool = Field(False, description="Serve token ids only; no tokenizer files needed.")
    served_model_name: list[str] | None = Field(
        None, description="Model name(s) the API answers to (vLLM's rule): the first is reported in responses, all "
        "are accepted in requests and listed by /v1/models; default: the model argument as given."
    )
    dtype: DTypeName = Field("auto", description="Weight and activation dtype.")
    max_model_len: int | None = Field(None, ge=1, description="Max prompt + output tokens per request.")
    seed: int = Field(0, ge=0, description="Seed for weight init (dummy) and unseeded sampling.")
    load_format: LoadFormat = Field("auto", description="How to load weights; 'dummy' makes random weights.")
    trust_remote_code: bool = Field(False, description="Accepted for compatibility; kvloom runs no remote code.")
    chat_template: str | None = Field(
        None, description="Chat template to use instead of the tokenizer's: a Jinja file or the template inline."
    )
    generation_config: str = Field(
        "auto", description="Default sampling parameters: 'auto' reads the model's generation_config.json, "
        "'vllm' (or 'kvloom') ignores it, or a folder holding one."
    )
    max_logprobs: int = Field(20, ge=0, le=20, description="The most logprobs a request may ask per token (0..20).")
    quantization: str | None = Field(
        None, description="Quantization method (vLLM's names): by default the checkpoint's quantization_config "
        "chooses it; a NAME such as fp8 quantizes an unquantized checkpoint while loading, or picks the method of a "
        "quantized one; 'none' runs the weights as stored (a GGUF file dequantized)."
    )
    runner: Literal["auto", "generate", "pooling"] = Field("auto", description="Generate text or pool embeddings.")
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = Field(None, description="Pooling for embeddings.")
    normalize: bool | None = Field(None, description="L2-normalise embeddings (default: yes).")
    io_processor_plugin: str | None = Field(None, description="IO processor plugin name (pooling models).")
    # ---- cache
    block_size: int | None = Field(None, ge=1, le=4096, description="Tokens per KV block (default: backend's choice).")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Fraction of GPU memory to use.")
    kv_cache_memory: int | str | None = Field(None, description="KV-cache bytes (e.g. 4GiB); overrides the fraction.")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="Force the number of KV blocks.")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV cache dtype (fp8: e4m3, half the bytes; scales from the checkpoint or 1.0)."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    prefix_caching_hash_algo: HashAlgo = Field("sha256", description="Block hash algorithm.")
    # ---- scheduler
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Max requests per step.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Max tokens per step.")
    long_prefill_token_threshold: int = Field(0, ge=0, description="Cap per-request prefill chunk (0 = off).")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="Queue order.")
    async_scheduling: bool | None = Field(
        None, description="Schedule step n+1 while step n runs on the device (overlaps host work). Default (auto): "
        "on where the platform's device runs asynchronously from the host (CUDA) and without pipeline parallelism, "
        "off elsewhere (the CPU); --no-async-scheduling turns it off."
    )
    # ---- parallel
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel ranks (worker processes on this machine, or Ray actors); must divide the model's "
        "num_attention_heads (Llama, Mistral, Qwen2, Qwen3 and their MoE variants)."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages (worker processes on this machine, times the tensor-parallel size), "
        "each with a contiguous run of the decoder layers; at most the model's num_hidden_layers (Llama, Mistral, "
        "Qwen2, Qwen3 and their MoE variants)."
    )
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None, description="How the workers run: uni (one worker in the engine core's process), mp (one process "
        "per rank on this machine) or ray (one Ray actor per rank, on the nodes of a Ray cluster; "
        "needs pip install ray); default: mp when --tensor-parallel-size or --pipeline-parallel-size > 1, else uni."
    )
    data_parallel_size: int = Field(
        1, ge=1, description="Model replicas, each an engine core process (one GPU each on CUDA; on the CPU they "
        "share the cores); requests go to the least loaded."
    )
    # ---- attention
    attention_backend: str | None = Field(
        None, description="Force an attention backend by NAME (for MLA models: the decode backend)."
    )
    mla_prefill_backend: str | None = Field(
        None, description="MLA models: force the prefill attention backend by NAME (default: by priority)."
    )
    # ---- compilation / CUDA graphs
    enforce_eager: bool = Field(False, description="No torch.compile and no CUDA graphs (explicit flags win).")
    optimization_level: int = Field(
        2, ge=0, le=3, description="-O0: eager; -O1: torch.compile + piecewise CUDA graphs; -O2/-O3: "
        "torch.compile + full decode graphs and piecewise graphs for the rest (FULL_AND_PIECEWISE)."
    )
    torch_compile: bool | None = Field(
        None, description="torch.compile the model (default: -O1 and above on platforms that compile by default: CUDA)."
    )
    use_inductor: bool = Field(True, description="Compile the pieces with Inductor (off: FX pieces, for debugging).")
    cudagraph_mode: CUDAGraphMode | None = Field(None, description="CUDA graph mode (default from -O).")
    cudagraph_capture_sizes: list[int] | None = Field(
        None, description="Token counts to capture graphs for (full decode graphs: those <= max_num_seqs)."
    )
    max_cudagraph_capture_size: int | None = Field(
        None, ge=1, description="Largest token count to capture (default min(2 x max_num_seqs, 512))."
    )
    custom_ops: Literal["all", "none"] | None = Field(
        None, description="Use the platform's fused layer kernels (all) or only torch ops (none); default: none "
        "when Inductor compiles the model (it fuses those ops itself), else all."
    )
    # ---- LoRA
    enable_lora: bool = Field(False, description="Allow LoRA adapters.")
    max_loras: int = Field(1, ge=1, le=256, description="Max adapters in one batch.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="Max adapter rank.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters kept loaded (default max_loras).")
    lora_modules: dict[str, str] | None = Field(None, description="name=path adapters to preload.")
    # ---- structured outputs
    structured_outputs_backend: str = Field(
        "xgrammar", description="Structured-output (guided decoding) backend: xgrammar or a plugin's name."
    )
    reasoning_parser: str | None = Field(
        None, description="How a reasoning model's reasoning is told from its answer: deepseek_r1, qwen3 or a "
        "kvloom.reasoning_parsers plugin's name. Chat responses then carry it in `reasoning`, and a structured "
        "output's grammar applies once the reasoning has ended."
    )
    structured_outputs_config: dict[str, Any] | None = Field(
        None, description="vLLM's structured-output options, a JSON object with the keys backend, reasoning_parser "
        "and enable_in_reasoning (true: the grammar also binds the reasoning)."
    )
    # ---- speculative decoding
    speculative_config: dict[str, Any] | None = Field(
        None, description="Speculative decoding, vLLM's JSON object: method (ngram, draft_model, eagle3, eagle, mtp, "
        "deepseek_mtp or a proposer plugin's), num_speculative_tokens, prompt_lookup_min/max (ngram), model (the "
        "draft or EAGLE-3 head checkpoint), draft_tensor_parallel_size, quantization (the draft's)."
    )
    # ---- KV transfer (connectors)
    kv_transfer_config: dict[str, Any] | None = Field(
        None, description="The KV connector, as vLLM's JSON: kv_connector (ExampleConnector, OffloadingConnector, "
        "P2pNcclConnector or a kvloom.kv_connectors plugin), kv_role (kv_producer, kv_consumer, kv_both), "
        "kv_connector_extra_config, kv_connector_module_path, kv_load_failure_policy (fail, recompute), ..."
    )
    kv_offloading_size: float | None = Field(
        None, gt=0, description="GiB of host memory that keep KV-cache blocks evicted from the device (the "
        "OffloadingConnector, loaded back on a prefix hit); off by default."
    )
    kv_offloading_backend: Literal["native", "lmcache"] = Field(
        "native", description="What offloads with --kv-offloading-size: native (kvloom's OffloadingConnector)."
    )
    # ---- observability
    # The one default of stats for LLM, kvloom generate/chat/serve/bench (LLM has none of its own).
    disable_log_stats: bool = Field(
        False, description="Turn engine stats off: no periodic stats line, no stat logger plugins, no engine metrics."
    )
    log_stats_interval: float = Field(
        5.0, gt=0.0, description="Seconds (> 0) between stats summaries (the stat loggers' log()); once more at shutdown."
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, v: int | str | None) -> int | None:
        if v is None:
            return None
        n = parse_memory_size(v)
        if n <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return n

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _served_names(cls, v: object) -> object:
        if isinstance(v, str):  # LLM(served_model_name="x"): one name
            v = [v]
        if isinstance(v, list):
            if not v:
                raise ValueError("give at least one name")
            if any(not isinstance(name, str) or not name.strip() for name in v):
                raise ValueError(f"names must be non-empty strings, got {v!r}")
            if len(set(v)) != len(v):
                raise ValueError(f"names must differ, got {v!r}")
        return v

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _kv_transfer_config(cls, v: Any) -> dict[str, Any] | None:
        config = parse_kv_transfer_config(v)
        return None if config is None else config.model_dump(exclude_defaults=True)

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, v: str | None) -> str | None:
        return check_requested_quantization(v)

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _capture_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if any(s < 1 for s in v):
            raise ValueError("cudagraph_capture_sizes must be positive batch sizes")
        return sorted(set(v))

    @model_validator(mode="before")
    @classmethod
    def _vllm_options(cls, data: Any) -> Any:
        """vLLM's options that are not fields: refused with why, or dropped with a warning."""
        if not isinstance(data, dict):
            return data
        from kvloom.entrypoints.cli.vllm_flags import python_option

        kept = {}
        for name, value in data.items():
            entry = None if name in cls.model_fields else python_option(name)
            if entry is None:
                kept[name] = value  # a field, or unknown: pydantic's extra_forbidden, described by _describe
            elif entry.status == "ignored":
                logger.warning("%s is ignored by kvloom (%s)", name, entry.note)
            else:
                raise ValueError(f"{name} is not supported by kvloom yet{_python_note(entry.note)}")
        return kept

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_config(cls, v: Any) -> dict[str, Any] | None:
        if v is None:
            return None
        # kvloom.config imports torch: only when the user asks for speculation.
        from kvloom.config import SpeculativeConfig

        config = SpeculativeConfig.from_user(v)
        return config.model_dump(exclude={"proposer", "draft"}, exclude_none=True)

    @field_validator("structured_outputs_config")
    @classmethod
    def _structured_outputs_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_structured_outputs_config(v)

    def structured_outputs_options(self) -> tuple[str, str | None, bool]:
        """(backend, reasoning parser, enable_in_reasoning) of the flat flags and
        ``structured_outputs_config`` (a ``ValueError`` when the two disagree)."""
        return structured_outputs_options(self.structured_outputs_backend, self.reasoning_parser,
                                          self.structured_outputs_config)  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> "EngineArgs":
        self.structured_outputs_options()
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to get one token per step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        return self


def _describe(exc: ValidationError) -> str:
    """kvloom's message for a ``ValidationError`` of ``EngineArgs``, fields by their Python names."""
    from kvloom.entrypoints.cli.validation import describe_validation_error

    return describe_validation_error(exc, EngineArgs, str)


def _python_note(note: str) -> str:
    """A ``VLLM_FLAGS`` note with its flags spelled as ``EngineArgs`` fields (``--runner`` -> ``runner``)."""

    def field(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        return name if name in EngineArgs.model_fields else match.group(0)

    return f" ({re.sub(r'--([a-z][a-z0-9-]*)', field, note)})" if note else ""
