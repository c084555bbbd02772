"""Checks of ``--tensor-parallel-size`` and ``--pipeline-parallel-size`` against the model
and the other flags, at start-up (``config_builder.create_engine_config``), so that a split
the model or a feature cannot run is refused by its flag before any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kvloom.executor.ray import import_ray
from kvloom.models.interface import supports_pp, supports_tp
from kvloom.models.registry import ModelRegistry

if TYPE_CHECKING:
    from kvloom.config import ModelConfig
    from kvloom.engine.arg_utils import EngineArgs


def check_tensor_parallel(args: EngineArgs, model: ModelConfig) -> Literal["uni", "mp", "ray"]:
    """Validate ``--tensor-parallel-size`` and ``--pipeline-parallel-size`` against the
    model and the other flags; the executor backend (``--distributed-executor-backend``,
    default mp above one rank)."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    backend = args.distributed_executor_backend or ("mp" if tp * pp > 1 else "uni")
    if backend == "ray":
        import_ray()  # a clear error now, not when the engine core starts
    if tp * pp == 1:
        return backend
    if backend == "uni":
        field = "tensor_parallel_size" if tp > 1 else "pipeline_parallel_size"
        raise ValueError(f"distributed_executor_backend: 'uni' runs one worker, but {field} is {max(tp, pp)} "
                         f"(allowed with {field} > 1: mp, ray)")  # fmt: skip
    model_cls = ModelRegistry.load_model_cls(model.architecture)
    if pp > 1:
        check_pipeline_parallel(args, model, model_cls)
    if tp > 1:
        _check_tensor_parallel_size(args, model, model_cls)
    return backend


def check_pipeline_parallel(args: EngineArgs, model: ModelConfig, model_cls: type) -> None:
    """``--pipeline-parallel-size`` above 1: a model that splits its layers, at most one
    stage per layer, and none of the features that stages do not carry yet."""
    pp = args.pipeline_parallel_size
    if not supports_pp(model_cls) or model.runner != "generate":
        raise ValueError(
            f"pipeline_parallel_size: {model.architecture} ({model.runner} runner) cannot be split into pipeline "
            "stages yet (allowed: 1); the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral generators can"
        )
    layers = int(getattr(model.hf_config, "num_hidden_layers", 0))
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size: {pp} stages for the model's {layers} layers "
                         f"(allowed: 1..{layers}, at least one layer per stage)")  # fmt: skip
    if args.async_scheduling:  # None (auto) resolves to off with pipeline stages
        raise ValueError(f"async_scheduling: True is not supported with pipeline_parallel_size {pp} yet (allowed: "
                         f"False, or unset); the stages keep {pp} micro-batches in flight instead")  # fmt: skip
    _check_no_unsupported_features(args, f"pipeline_parallel_size {pp}")


def _check_tensor_parallel_size(args: EngineArgs, model: ModelConfig, model_cls: type) -> None:
    tp = args.tensor_parallel_size
    if not supports_tp(model_cls) or model.runner != "generate":
        raise ValueError(
            f"tensor_parallel_size: {model.architecture} ({model.runner} runner) has no tensor-parallel layers yet "
            f"(allowed: 1); the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral generators have"
        )
    if model.num_heads % tp != 0:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's num_attention_heads "
                         f"({model.num_heads}); allowed: a divisor of {model.num_heads}")  # fmt: skip
    kv = model.num_kv_heads
    if kv % tp != 0 and tp % kv != 0:
        raise ValueError(f"tensor_parallel_size: {tp} neither divides nor is a multiple of the model's "
                         f"num_key_value_heads ({kv})")  # fmt: skip
    # The dense MLPs' and the experts' (Qwen3-MoE: moe_intermediate_size) hidden sizes are split.
    for field in ("intermediate_size", "moe_intermediate_size"):
        intermediate = getattr(model.hf_config, field, None)
        if intermediate is not None and intermediate % tp != 0:
            raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {field} ({intermediate})")
    _check_no_unsupported_features(args, f"tensor_parallel_size {tp}")


def _check_no_unsupported_features(args: EngineArgs, what: str) -> None:
    for flag, value, allowed in (
        ("enable_lora", args.enable_lora, False),
        ("data_parallel_size", args.data_parallel_size, 1),
    ):
        if value != allowed:
            raise ValueError(f"{flag}: {value!r} is not supported with {what} yet (allowed: {allowed!r})")
