"""The public face for out-of-tree model authors: the layers kvloom's own models are built
from, the paged ``Attention`` layer, and the weight-loading helpers.

A model class is registered by a general plugin (``ModelRegistry.register_model`` in a
``register()`` function or a ``kvloom_register_models`` hook) and built as
``Model(config: EngineConfig, prefix: str = "")`` on the target device in the run dtype.
It implements ``forward(input_ids [N], positions [N]) -> hidden [N, hidden_size]``,
``compute_logits(hidden [M, hidden_size]) -> logits [M, vocab]`` (any float dtype: the
sampler computes in float32 where it needs to) and
``load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]`` (the HF names it
loaded); ``docs/plugins.md`` says what each layer expects. Its attention layers are
``Attention`` modules built with ``config.attention.backend``, the backend the engine
selected; the model runner finds them and binds their KV caches.

``LlamaForCausalLM`` is kvloom's Llama, whole: register it under another architecture
name for checkpoints of Llama's structure, or subclass it for a Llama variant; its
``attention_kwargs(hf_config)`` classmethod returns the attention block's flags
(``qkv_bias``, ``o_bias``, ``qk_norm``), which is all kvloom's Qwen2 and Qwen3 change.
A mixture-of-experts model builds its experts as a ``FusedMoE`` (stacked expert weights,
loaded per expert from the checkpoint; the ``fused_moe`` custom op) with a router of its
own, and may override ``LlamaForCausalLM.mlp_block`` to put it in the Llama decoder;
``select_experts`` is the routing (HF's Mixtral, Qwen3-MoE and DeepSeek-V2/V3 variants).
A model class that sets ``accepts_lazy_weights = True`` next to its ``load_weights`` gets
safetensors tensors as ``LazyTensor`` handles (the parallel layers read only their
rank's slice); ``materialize`` reads one whole (the identity on a tensor).
A model with multi-head latent attention (DeepSeek-style) builds each attention block as
an ``MLAAttention`` (HF module names, the latent cache, both phases) from ``MLADims``
(``config.model.mla_dims``), ``config.attention.backend`` (decode) and
``config.attention.prefill_backend``; ``deepseek_softmax_scale`` is DeepSeek's softmax
scale with its YaRN correction.
What a model class may declare beyond the contract (pipeline and tensor parallelism,
LoRA on merged projections, stacked checkpoint parameters, lazy weights) is a protocol each:
``SupportsPP``, ``SupportsTP``, ``SupportsLoRA``, ``HasStackedParams``,
``SupportsLazyWeights``; the engine reads them through ``supports_pp``, ``supports_tp``,
``supports_lazy_weights``, ``get_packed_modules_mapping``, ``get_stacked_params`` and
``get_checkpoint_tensor_filter``, which a model's tests can call too.
``kvloom.testing.load_model`` and ``kvloom.testing.forward_context`` run a model class in
a test, outside the engine.
"""

from kvloom.attention.layer import Attention
from kvloom.attention.mla_backend import MLADims
from kvloom.attention.mla_layer import MLAAttention
from kvloom.config import EngineConfig
from kvloom.layers.activation import SiluAndMul, get_gated_activation
from kvloom.layers.fused_moe import FusedMoE, select_experts
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear, MergedLinear, QKVLinear
from kvloom.layers.rotary import RotaryEmbedding, deepseek_softmax_scale, get_rope_parameters
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding
from kvloom.loader.lazy_tensor import LazyTensor, materialize
from kvloom.models.causal_lm import CausalLM
from kvloom.models.interface import (
    HasStackedParams,
    SupportsLazyWeights,
    SupportsLoRA,
    SupportsPP,
    SupportsTP,
    get_checkpoint_tensor_filter,
    get_packed_modules_mapping,
    get_stacked_params,
    supports_lazy_weights,
    supports_pp,
    supports_tp,
)
from kvloom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvloom.models.weights import LLAMA_STACKED_PARAMS, load_checkpoint_weights, packed_modules_mapping

__all__ = [
    "LLAMA_STACKED_PARAMS",
    "Attention",
    "CausalLM",
    "EngineConfig",
    "FusedMoE",
    "HasStackedParams",
    "LMHead",
    "LazyTensor",
    "Linear",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "MLAAttention",
    "MLADims",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "SupportsLazyWeights",
    "SupportsLoRA",
    "SupportsPP",
    "SupportsTP",
    "VocabEmbedding",
    "deepseek_softmax_scale",
    "get_checkpoint_tensor_filter",
    "get_gated_activation",
    "get_packed_modules_mapping",
    "get_rope_parameters",
    "get_stacked_params",
    "load_checkpoint_weights",
    "materialize",
    "packed_modules_mapping",
    "select_experts",
    "supports_lazy_weights",
    "supports_pp",
    "supports_tp",
]

# Docstrings of the re-exported values, for the API reference (scripts/build-api-docs.sh):
# pdoc reads a string after an annotated name as that name's docstring. The bare
# annotation binds nothing; the value is the import above.

LLAMA_STACKED_PARAMS: tuple[tuple[str, str, str], ...]
"""``(merged module, HF checkpoint module, shard)`` of the Llama family: ``q_proj``,
``k_proj``, ``v_proj`` -> ``qkv_proj`` shards ``q``, ``k``, ``v``; ``gate_proj``,
``up_proj`` -> ``gate_up_proj`` shards ``"0"``, ``"1"``. Pass it to
``load_checkpoint_weights`` and ``packed_modules_mapping``."""
