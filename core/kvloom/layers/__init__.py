"""Building blocks of the model classes (see ``docs/architecture.md``, "Models")."""

from kvloom.layers.activation import SiluAndMul, get_gated_activation
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear, LinearBase, MergedLinear, QKVLinear
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding

__all__ = [
    "LMHead",
    "Linear",
    "LinearBase",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "get_gated_activation",
    "get_rope_parameters",
]
