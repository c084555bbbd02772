"""What a prompt may be, for every entry point (``LLM``, ``LLMEngine``, ``AsyncLLM``, IO
processor plugins): one definition, as vLLM's ``vllm.inputs.PromptType``. It sits in a
leaf module so that the engine and the plugin contract import it without a cycle.
"""

from __future__ import annotations

from typing import Any

#: Text, ``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"`` text), or ``{"prompt": str}``.
PromptType = str | dict[str, Any]
