"""Architecture name -> model class.

Built-in models are listed lazily (module, class) so importing the registry is cheap.
Out-of-tree models register from a general plugin::

    from kvloom import ModelRegistry
    ModelRegistry.register_model("MyForCausalLM", "my_pkg.model:MyForCausalLM")
"""

from __future__ import annotations

import importlib
import logging

from torch import nn

logger = logging.getLogger(__name__)

_BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvloom.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kvloom.models.qwen3:Qwen3ForCausalLM",
    "DeepseekV2ForCausalLM": "kvloom.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "kvloom.models.deepseek_v2:DeepseekV3ForCausalLM",
    "Qwen3MoeForCausalLM": "kvloom.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "kvloom.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "kvloom.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "kvloom.models.gemma2:Gemma3ForCausalLM",
    # Gemma 3's multimodal checkpoints, text only (the language model).
    "Gemma3ForConditionalGeneration": "kvloom.models.gemma2:Gemma3ForConditionalGeneration",
    "GptOssForCausalLM": "kvloom.models.gpt_oss:GptOssForCausalLM",
    # Decoders saved without their LM head: embedding models (runner "pooling").
    "LlamaModel": "kvloom.models.embedding:LlamaEmbeddingModel",
    "MistralModel": "kvloom.models.embedding:LlamaEmbeddingModel",
    "Qwen2Model": "kvloom.models.embedding:Qwen2EmbeddingModel",
    "Qwen3Model": "kvloom.models.embedding:Qwen3EmbeddingModel",
    # Decoders with a classification head (cross-encoders, rerankers; runner "pooling").
    "LlamaForSequenceClassification": "kvloom.models.classification:LlamaForSequenceClassification",
    "MistralForSequenceClassification": "kvloom.models.classification:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "kvloom.models.classification:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "kvloom.models.classification:Qwen3ForSequenceClassification",
}

#: The embedding architecture that runs a causal LM with runner "pooling" (its LM head is
#: then neither loaded nor needed).
_POOLING_VARIANTS: dict[str, str] = {
    "LlamaForCausalLM": "LlamaModel",
    "MistralForCausalLM": "MistralModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}

#: Architectures whose natural runner is pooling (embedding and classification models).
_POOLING_SUFFIXES = ("Model", "ForEmbedding", "EmbeddingModel", "ForSequenceClassification")


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, str | type[nn.Module]] = dict(_BUILTIN_MODELS)

    def register_model(self, architecture: str, model_cls: str | type[nn.Module]) -> None:
        """Register ``architecture`` as a class or a lazy "module:Class" string.
        Re-registering the same target is a no-op (plugins must be re-entrant)."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"model class for {architecture!r} must be 'module:Class', got {model_cls!r}")
        existing = self._models.get(architecture)
        if existing is not None and existing != model_cls:
            logger.warning("Model architecture %s is overridden by %s", architecture, model_cls)
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def is_supported(self, architecture: str) -> bool:
        return architecture in self._models

    def resolve_architecture(self, architectures: list[str], model: str = "") -> str:
        for arch in architectures:
            if arch in self._models:
                return arch
        raise ValueError(
            f"model architecture {architectures or '(none)'} of {model or 'the model'} is not supported; "
            f"supported architectures: {', '.join(self.get_supported_archs())}"
        )

    def is_pooling_architecture(self, architecture: str) -> bool:
        return not architecture.endswith("ForCausalLM") and architecture.endswith(_POOLING_SUFFIXES)

    def pooling_architecture(self, architecture: str) -> str:
        """The architecture to build for ``runner="pooling"``: a built-in causal LM's
        headless variant, else ``architecture`` itself (its hidden states are pooled)."""
        variant = _POOLING_VARIANTS.get(architecture)
        if variant is None or self._models.get(architecture) != _BUILTIN_MODELS.get(architecture):
            return architecture  # not built in, or replaced by a plugin: use it as registered
        return variant

    def load_model_cls(self, architecture: str) -> type[nn.Module]:
        target = self._models.get(architecture)
        if target is None:
            self.resolve_architecture([architecture])
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target  # type: ignore[return-value]


#: The process-wide registry (vLLM's name).
ModelRegistry = _ModelRegistry()


def is_classification_architecture(architecture: str) -> bool:
    """Whether ``architecture`` pools into a classification head's logits (HF's
    ``*ForSequenceClassification``) instead of an embedding."""
    return architecture.endswith("ForSequenceClassification")
