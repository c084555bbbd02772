"""A general plugin written with pluggy hooks (see kvloom.hookspecs for every hook)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvloom.interfaces import hookimpl

KVLOOM_PLUGIN_API = "1.0"

#: A site policy this plugin enforces: never batch more than this many requests.
MAX_NUM_SEQS_CAP = 64

#: Tests set this to a file: each kvloom_update_engine_config call appends one JSON line
#: describing the config the hook received.
CALLS_ENV = "KVLOOM_TEST_GENERAL_PLUGIN_CALLS"


@hookimpl
def kvloom_register_models(model_registry: Any) -> None:
    # A class of this plugin (models.py), imported when such a checkpoint is loaded.
    model_registry.register_model(
        "KvloomTestQwen2ForCausalLM", "kvloom_test_general_plugin.models:KvloomTestQwen2ForCausalLM"
    )


@hookimpl
def kvloom_update_engine_config(config: Any) -> None:
    if os.environ.get(CALLS_ENV):
        seen = {
            "config_type": type(config).__name__,
            "platform": config.device.platform.name,
            "backend": config.attention.backend.NAME,
            # Whatever the user asked for, the CPU platform turns graphs off before this hook runs.
            "cudagraph_mode": config.compilation.cudagraph_mode.value,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "pid": os.getpid(),
        }
        with open(os.environ[CALLS_ENV], "a") as f:
            f.write(json.dumps(seen) + "\n")
    if config.scheduler.max_num_seqs > MAX_NUM_SEQS_CAP:
        config.scheduler.max_num_seqs = MAX_NUM_SEQS_CAP
