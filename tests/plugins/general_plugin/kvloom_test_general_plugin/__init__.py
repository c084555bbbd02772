"""A general plugin that registers a model architecture with a register() function.

Checkpoints whose config.json says "KvloomTestLlamaForCausalLM" have Llama's structure,
so the architecture name is mapped onto kvloom's Llama implementation (lazily, as a
"module:Class" string: nothing is imported until such a model is loaded).
"""

from kvloom.interfaces import ModelRegistry

KVLOOM_PLUGIN_API = "1.0"


def register() -> None:
    # Re-entrant: registering the same target again is a no-op.
    ModelRegistry.register_model("KvloomTestLlamaForCausalLM", "kvloom.interfaces.models:LlamaForCausalLM")
