"""kvloom-example-model: registers Granite (``GraniteForCausalLM``) with kvloom.

``register()`` is the general plugin's entry point, called once in every process that
loads kvloom's plugins (so it must be cheap and re-entrant). The model class is named as a
lazy "module:Class" string: ``model.py`` is imported only when a Granite checkpoint loads.
"""

from __future__ import annotations

from kvloom.interfaces import ModelRegistry

KVLOOM_PLUGIN_API = "1.1"


def register() -> None:
    ModelRegistry.register_model("GraniteForCausalLM", "kvloom_example_model.model:GraniteForCausalLM")
