"""Selecting the IO processor plugin of a pooling model.

The plugin is named by ``--io-processor-plugin`` (``EngineArgs.io_processor_plugin``) or,
failing that, by the model config's ``io_processor_plugin`` field (resolved into
``ModelConfig.io_processor_plugin``); kvloom builds it with the ``EngineConfig``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvloom import plugins

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.io_processor import IOProcessor, PromptType

logger = logging.getLogger(__name__)


def load_io_processor(config: "EngineConfig") -> "IOProcessor | None":
    """The configured IO processor, or None when there is none."""
    name = config.model.io_processor_plugin
    if name is None:
        return None
    if config.model.runner != "pooling":
        raise ValueError(
            f"io_processor_plugin: {name!r} needs a pooling model, but this model generates text "
            "(start it with runner='pooling')"
        )
    processor = plugins.get_io_processor_cls(name)(config)
    logger.info("IO processor plugin %s (%s) is active", name, type(processor).__qualname__)
    return processor


def as_prompt_list(prompts: "PromptType | Sequence[PromptType]") -> list[Any]:
    """A plugin's ``pre_process`` result as a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)
