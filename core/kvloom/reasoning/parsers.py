"""The built-in reasoning parsers. Both read ``<think> ... </think>``; they differ in what an
output without the start marker is."""

from __future__ import annotations

from typing import ClassVar

from kvloom.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills (and QwQ): the chat template opens the reasoning, so the
    output reasons from its first token until ``</think>`` (an output that opens with
    ``<think>`` itself, as older templates let it, has it dropped)."""

    name: ClassVar[str] = "deepseek_r1"
    reasoning_by_default: ClassVar[bool] = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens its reasoning with ``<think>``; an output that does not is all
    answer. ``enable_thinking=False`` (``chat_template_kwargs``) writes an empty
    ``<think></think>`` into the prompt: the whole output is then the answer."""

    name: ClassVar[str] = "qwen3"
    reasoning_by_default: ClassVar[bool] = False
