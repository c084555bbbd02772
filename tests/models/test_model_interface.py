"""The model-capability protocols (``kvloom.models.interface``): what each helper answers for
a model that declares a capability, one that declares nothing, a class and an instance, and
that the engine refuses parallel sizes by them."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from kvloom.interfaces import ModelRegistry
from kvloom.interfaces.models import (
    LLAMA_STACKED_PARAMS,
    LlamaForCausalLM,
    get_checkpoint_tensor_filter,
    get_packed_modules_mapping,
    get_stacked_params,
    packed_modules_mapping,
    supports_lazy_weights,
    supports_pp,
    supports_tp,
)
from kvloom.testing import resolve_engine_config
from kvloom.testing.models import tiny_model_dir


class Plain(nn.Module):
    """A model that declares no capability."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


class LlamaOwnLoader(LlamaForCausalLM):
    """Overrides ``load_weights`` without declaring ``accepts_lazy_weights`` again."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


def test_llama_declares_every_capability() -> None:
    assert supports_pp(LlamaForCausalLM) and supports_tp(LlamaForCausalLM)
    assert supports_lazy_weights(LlamaForCausalLM)
    assert get_stacked_params(LlamaForCausalLM) == LLAMA_STACKED_PARAMS
    assert get_packed_modules_mapping(LlamaForCausalLM) == packed_modules_mapping(LLAMA_STACKED_PARAMS)
    assert get_packed_modules_mapping(LlamaForCausalLM)["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]


def test_a_model_that_declares_nothing_gets_the_defaults() -> None:
    for model in (Plain, Plain()):  # a class or an instance
        assert not supports_pp(model) and not supports_tp(model) and not supports_lazy_weights(model)
        assert get_stacked_params(model) == () and get_packed_modules_mapping(model) == {}
        assert get_checkpoint_tensor_filter(model) is None


def test_lazy_weights_belong_to_the_class_that_defines_load_weights() -> None:
    # Inherited flags hold for TP/PP, but a new load_weights gets whole tensors unless it
    # declares accepts_lazy_weights itself (it may index the tensors it receives).
    assert supports_pp(LlamaOwnLoader) and not supports_lazy_weights(LlamaOwnLoader)


def test_packed_modules_mapping_is_a_copy() -> None:
    get_packed_modules_mapping(LlamaForCausalLM)["qkv_proj"] = ["changed"]
    assert get_packed_modules_mapping(LlamaForCausalLM)["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]


@pytest.mark.parametrize(
    ("size", "message"),
    [("pipeline_parallel_size", "cannot be split into pipeline stages"),
     ("tensor_parallel_size", "has no tensor-parallel layers")],
)  # fmt: skip
def test_the_engine_refuses_parallel_sizes_a_model_does_not_support(size: str, message: str) -> None:
    # DeepSeek-V2 declares neither capability.
    assert not supports_pp(_deepseek_cls()) and not supports_tp(_deepseek_cls())
    with pytest.raises(ValueError, match=f"{size}: DeepseekV2ForCausalLM .*{message}"):
        resolve_engine_config(model=str(tiny_model_dir("deepseek_v2")), distributed_executor_backend="mp", **{size: 2})


def _deepseek_cls() -> type:
    return ModelRegistry.load_model_cls("DeepseekV2ForCausalLM")
