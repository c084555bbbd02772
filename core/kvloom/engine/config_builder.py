"""``create_engine_config``: the user's ``EngineArgs`` resolved into the ``EngineConfig``
every component receives.

The order matters and is the same in every process; ``create_engine_config`` runs these
stages one after the other:

1. load plugins (so out-of-tree models and backends are registered) and pick the platform;
2. read the model's config and settle its section (``_model_config``): architecture,
   dtype, ``max_model_len``, runner;
3. check tensor and pipeline parallelism against the model (``parallel_checks.py``);
4. select the attention backend (``_attention_config``), which may choose the block size;
5. the cache and scheduler sections;
6. settle compilation and the CUDA-graph mode (``compile_config.py``; NONE on a platform
   without ``supports_cuda_graphs``);
7. let the platform (``check_and_update_config``), then the general plugins'
   ``kvloom_update_engine_config`` hook, adjust the result, each checked
   (``_check_adjusted``: what they may not change, and what the backend cannot serve);
8. check that the machine holds the data-parallel replicas and that the KV connector
   (``kv_transfer_config``) can run the engine, and log what the engine runs with.

``EngineArgs`` itself lives in ``arg_utils.py``, which must import without torch (the
CLI builds its flags from it); this module imports the engine's modules.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvloom import plugins
from kvloom.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvloom.engine.arg_utils import DTYPES, EngineArgs
from kvloom.engine.attention_config import attention_config, backend_problems
from kvloom.engine.compile_config import resolve_compilation
from kvloom.engine.parallel_checks import check_tensor_parallel
from kvloom.kv_transfer.config import offloading_transfer_config, parse_kv_transfer_config
from kvloom.kv_transfer.factory import check_transfer_config
from kvloom.loader.generation_config import generation_defaults, resolve_chat_template
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from kvloom.models.registry import ModelRegistry, is_classification_architecture
from kvloom.quantization.selection import quantization_for_engine
from kvloom.spec_decode.registry import resolve_speculative
from kvloom.structured_output.options import structured_outputs_config

if TYPE_CHECKING:
    from kvloom.loader.model_source import ModelSource
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: The per-step token budget with chunked prefill when ``--max-num-batched-tokens`` is unset.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve ``args`` into the ``EngineConfig`` every component receives (the stages of
    the module docstring, in its order)."""
    plugins.load_plugins()
    platform = plugins.current_platform()
    source = resolve_model_source(args.model, args.load_format, tokenizer=args.tokenizer, revision=args.revision,
                                  tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir)
    model, model_limit = _model_config(args, platform, source)
    executor_backend = check_tensor_parallel(args, model)
    if args.trust_remote_code:
        logger.info("--trust-remote-code: kvloom runs no code from model repositories; the flag changes nothing")
    attention, block_size = attention_config(args, platform, model)
    cache = _cache_config(args, block_size)
    scheduler = _scheduler_config(args, model.max_model_len, platform)
    compilation = resolve_compilation(
        args, platform, attention.backend, scheduler.max_num_batched_tokens, use_mla=model.use_mla
    )
    config = EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                distributed_executor_backend=executor_backend,
                                data_parallel_size=args.data_parallel_size),  # fmt: skip
        attention=attention,
        load=LoadConfig(load_format=args.load_format, source_kind=source.kind),
        compilation=compilation,
        lora=LoRAConfig(
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras or args.max_loras,
            lora_modules=args.lora_modules or {},
        ),
        observability=ObservabilityConfig(
            disable_log_stats=args.disable_log_stats, log_stats_interval=args.log_stats_interval
        ),
        device=DeviceConfig(platform=platform, device_type=platform.device_type),
        structured_outputs=structured_outputs_config(*args.structured_outputs_options()),
        kv_transfer=_kv_transfer_config(args),
    )
    config.speculative = resolve_speculative(args.speculative_config, config)
    _let_platform_and_plugins_adjust(config, model_limit)
    if config.parallel.data_parallel_size > 1:  # now, naming the flag, if the machine cannot hold the replicas
        for index in range(config.parallel.data_parallel_size):
            platform.data_parallel_env(index, config.parallel.data_parallel_size)
    check_transfer_config(config)
    _log_resolved(config)
    return config


# ---------------------------------------------------------------------- the model


def _model_config(args: EngineArgs, platform: type[Platform], source: ModelSource) -> tuple[ModelConfig, int]:
    """The model section, and the longest ``max_model_len`` the model allows (its own
    limit, capped by a sliding window): the platform and plugins may not go past it."""
    hf_config = load_hf_config(source)
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = ModelRegistry.resolve_architecture(architectures, model=source.path)
    dtype = resolve_dtype(args.dtype, hf_config, platform.supported_dtypes, platform.name)
    model_limit = _model_length_limit(args.max_model_len, hf_config)
    # vLLM's rule: the names given, else the model argument exactly as typed.
    served_names = list(args.served_model_name or [args.model if args.model is not None else source.display_name])
    runner = args.runner
    if runner == "auto":
        runner = "pooling" if ModelRegistry.is_pooling_architecture(architecture) else "generate"
    model = ModelConfig(
        model=source.path,
        tokenizer=source.tokenizer_path,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=served_names[0],
        served_model_names=served_names,
        hf_config=hf_config,
        architecture=architecture,
        dtype=dtype,
        max_model_len=args.max_model_len or model_limit,
        seed=args.seed,
        runner=runner,
        pooling_type=args.pooling_type or "LAST",
        # A classification head's logits are scores, not directions: not normalised by default.
        normalize=not is_classification_architecture(architecture) if args.normalize is None else args.normalize,
        io_processor_plugin=args.io_processor_plugin or getattr(hf_config, "io_processor_plugin", None),
        chat_template=resolve_chat_template(args.chat_template),
        generation_defaults=generation_defaults(args.generation_config, source.path),
        max_logprobs=args.max_logprobs,
        quantization=quantization_for_engine(
            hf_config, args.quantization, platform, dtype, tensor_parallel_size=args.tensor_parallel_size,
            gguf=source.kind == "gguf", model=source.path,
        ),
    )
    return model, model_limit


def resolve_dtype(
    requested: str, hf_config: object, platform_dtypes: tuple[torch.dtype, ...], platform: str
) -> torch.dtype:
    """The model's dtype: ``requested`` (a ``--dtype`` name) if the platform supports it,
    else for "auto" the platform's preferred one (or the checkpoint's half type)."""
    if requested != "auto":
        dtype = getattr(torch, DTYPES[requested])
        if dtype not in platform_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in platform_dtypes)
            raise ValueError(f"dtype: {requested} is not supported on platform {platform} (allowed: {allowed})")
        return dtype
    # "auto": the platform's preferred dtype, except that a half-precision checkpoint stays
    # in its own half type where the platform supports it and prefers half precision.
    preferred = platform_dtypes[0]
    # transformers >= 4.56 names it `dtype` (reading `torch_dtype` there logs a deprecation
    # warning); older versions only have `torch_dtype`.
    config_dtype = getattr(hf_config, "dtype", None)
    if config_dtype is None and "dtype" not in getattr(hf_config, "__dict__", {}):
        config_dtype = getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    half = config_dtype in (torch.float16, torch.bfloat16)
    if preferred != torch.float32 and half and config_dtype in platform_dtypes:
        return config_dtype
    return preferred


def _model_length_limit(requested: int | None, hf_config: object) -> int:
    """The longest context the model allows; refuses a ``--max-model-len`` (``requested``)
    beyond it."""
    limit = _derived_max_model_len(hf_config)
    if requested is not None and requested > limit:
        raise ValueError(
            f"max_model_len: {requested} exceeds the model's maximum of {limit} (allowed: 1..{limit})"
        )
    return limit


def _derived_max_model_len(hf_config: object) -> int:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


# ---------------------------------------------------------------------- attention, cache, scheduler


def _cache_config(args: EngineArgs, block_size: int) -> CacheConfig:
    return CacheConfig(
        block_size=block_size,
        user_specified_block_size=args.block_size is not None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,  # already bytes after validation
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
    )


def _kv_transfer_config(args: EngineArgs) -> KVTransferConfig | None:
    """The KV connector of ``--kv-transfer-config`` or ``--kv-offloading-size``, with an
    ``engine_id`` (a fresh one unless given), or None."""
    transfer = offloading_transfer_config(parse_kv_transfer_config(args.kv_transfer_config), args.kv_offloading_size,
                                          args.kv_offloading_backend)  # fmt: skip
    if transfer is None or transfer.kv_connector is None:
        return None
    if transfer.engine_id is None:
        transfer.engine_id = uuid.uuid4().hex
    return transfer


def _scheduler_config(args: EngineArgs, max_model_len: int, platform: type[Platform]) -> SchedulerConfig:
    """The scheduler section; its token budget per step and whether steps overlap."""
    if args.enable_chunked_prefill:
        max_batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    else:
        # Without chunking, a whole prompt must fit into one step. A smaller budget the user
        # set is refused rather than silently raised (vLLM refuses it too).
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {args.max_num_batched_tokens} is smaller than max_model_len "
                f"({max_model_len}); with chunked prefill off (--no-enable-chunked-prefill) a whole prompt must fit "
                f"into one step: set --max-num-batched-tokens >= {max_model_len} or lower --max-model-len"
            )
        max_batched = max(args.max_num_batched_tokens or 0, max_model_len, args.max_num_seqs)
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        async_scheduling=resolve_async_scheduling(args.async_scheduling, platform, args.pipeline_parallel_size,
                                                  speculative=args.speculative_config is not None),
    )


def resolve_async_scheduling(
    requested: bool | None, platform: type[Platform], pipeline_parallel_size: int, *, speculative: bool = False
) -> bool:
    """``--async-scheduling`` / ``--no-async-scheduling`` as given; without either (None),
    on where the platform's device runs asynchronously from the host
    (``Platform.supports_async_scheduling``) and there is one pipeline stage (pipeline
    parallelism keeps its micro-batches in flight instead; an explicit
    ``--async-scheduling`` with it was refused by ``check_pipeline_parallel``). Off with
    speculative decoding, asked for or not: a step's drafts follow the previous step's
    accepted tokens, so steps cannot overlap (a warning when it was asked for). Logs the
    outcome and why."""
    if speculative:
        if requested:
            logger.warning("--async-scheduling is off with speculative decoding: each step's drafts need the "
                           "previous step's accepted tokens, so steps run one after the other")  # fmt: skip
        value, why = False, "speculative decoding: each step's drafts follow the previous step's accepted tokens"
    elif requested is not None:
        value = requested
        why = "--async-scheduling" if requested else "--no-async-scheduling"
        if requested and not platform.supports_async_scheduling:
            why += f" (platform {platform.name} runs steps synchronously: correct, nothing to overlap)"
    elif pipeline_parallel_size > 1:
        value = False
        why = f"default: pipeline parallelism keeps {pipeline_parallel_size} micro-batches in flight instead"
    elif platform.supports_async_scheduling:
        value, why = True, f"default: platform {platform.name} runs the device asynchronously from the host"
    else:
        value, why = False, f"default: platform {platform.name} runs steps synchronously, nothing to overlap"
    logger.info("Async scheduling %s (%s)", "on" if value else "off", why)
    return value


# ---------------------------------------------------------------------- the platform's and plugins' adjustments

#: (section, field) that a platform's check_and_update_config and the general plugins'
#: kvloom_update_engine_config must leave as resolved: the model (but its max_model_len),
#: the selected attention backend, the platform.
FIXED_FIELDS: tuple[tuple[str, str], ...] = (
    *(("model", f) for f in ModelConfig.model_fields if f != "max_model_len"),
    ("attention", "requested_backend"),
    ("attention", "backend"),
    ("attention", "requested_prefill_backend"),
    ("attention", "prefill_backend"),
    ("device", "platform"),
    ("device", "device_type"),
)


def _let_platform_and_plugins_adjust(config: EngineConfig, model_limit: int) -> None:
    """The platform's ``check_and_update_config``, then the general plugins' hooks, may
    change ``config`` in place; each is checked after it ran."""
    platform = config.device.platform
    resolved = _fixed_fields(config)
    platform.check_and_update_config(config)
    _check_adjusted(config, resolved, f"check_and_update_config of platform {platform.name}", model_limit)
    plugins.call_update_engine_config(config)
    _check_adjusted(config, resolved, "general plugins' kvloom_update_engine_config hooks", model_limit)


def _fixed_fields(config: EngineConfig) -> dict[str, object]:
    fixed = {f"{section}.{field}": getattr(getattr(config, section), field) for section, field in FIXED_FIELDS}
    # The speculative section as a whole (the KV cache and the runner are built for it).
    fixed["speculative"] = config.speculative.model_copy() if config.speculative is not None else None
    return fixed


def _check_adjusted(config: EngineConfig, resolved: dict[str, object], who: str, max_len: int) -> None:
    """Refuse what ``who`` left in ``config`` that the engine cannot run: a changed fixed
    field, max_model_len out of step or range, a block size or KV-cache dtype the selected
    backend does not serve."""

    def same(a: object, b: object) -> bool:
        if a is b:
            return True
        try:
            return bool(a == b)
        except Exception:
            return False

    changed = [name for name, value in _fixed_fields(config).items() if not same(value, resolved[name])]
    if changed:
        raise ValueError(
            f"EngineConfig: the {who} changed {', '.join(changed)}, which must not change once resolved "
            "(the model, the attention backend, the platform and speculative decoding are fixed; see docs/plugins.md, "
            "'The engine config')"
        )
    model_len, scheduler_len = config.model.max_model_len, config.scheduler.max_model_len
    if model_len != scheduler_len:
        raise ValueError(
            f"EngineConfig: after the {who}, model.max_model_len ({model_len}) and scheduler.max_model_len "
            f"({scheduler_len}) must be equal (change both)"
        )
    if model_len > max_len:
        raise ValueError(
            f"EngineConfig: after the {who}, max_model_len {model_len} exceeds the model's maximum of {max_len}"
        )
    reasons = backend_problems(config)
    if reasons:
        raise ValueError(
            f"EngineConfig: after the {who}, attention backend {config.attention.backend.NAME} cannot serve the "
            "adjusted config: " + "; ".join(reasons)
        )


def _log_resolved(config: EngineConfig) -> None:
    """What the engine runs with, after the platform and the hooks."""
    platform = config.device.platform
    logger.info(
        "kvloom config: model=%s served_model_name=%s arch=%s dtype=%s max_model_len=%d platform=%s device=%s "
        "backend=%s block_size=%d",
        Path(config.model.model).name,
        config.model.served_model_name,
        config.model.architecture,
        str(config.model.dtype).removeprefix("torch."),
        config.model.max_model_len,
        platform.name,
        platform.get_device_name(),
        config.attention.backend.NAME,
        config.cache.block_size,
    )
