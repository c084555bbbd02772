"""kvloom-gemma: registers Gemma (``GemmaForCausalLM``) with kvloom, out of tree.

The general plugin's ``register()`` runs once in every process that loads kvloom's
plugins; it names the model class as a lazy "module:Class" string, so the model module
is imported only when a Gemma checkpoint is loaded.
"""

from __future__ import annotations

KVLOOM_PLUGIN_API = "1.1"


def register() -> None:
    from kvloom.interfaces import ModelRegistry

    ModelRegistry.register_model("GemmaForCausalLM", "kvloom_gemma.model:GemmaForCausalLM")
