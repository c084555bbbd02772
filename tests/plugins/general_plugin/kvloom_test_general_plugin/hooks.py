"""A general plugin written with pluggy hooks (see kvloom.hookspecs for every hook)."""

from __future__ import annotations

from typing import Any

from kvloom.interfaces import hookimpl

KVLOOM_PLUGIN_API = "1.0"

#: A site policy this plugin enforces: never batch more than this many requests.
MAX_NUM_SEQS_CAP = 64


@hookimpl
def kvloom_register_models(model_registry: Any) -> None:
    # A class of this plugin (models.py), imported when such a checkpoint is loaded.
    model_registry.register_model(
        "KvloomTestQwen2ForCausalLM", "kvloom_test_general_plugin.models:KvloomTestQwen2ForCausalLM"
    )


@hookimpl
def kvloom_update_engine_config(config: Any) -> None:
    if config.scheduler.max_num_seqs > MAX_NUM_SEQS_CAP:
        config.scheduler.max_num_seqs = MAX_NUM_SEQS_CAP
