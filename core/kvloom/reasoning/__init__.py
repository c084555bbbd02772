"""Reasoning parsers: ``base`` (the contract and the splitter), the built-in ``deepseek_r1``
and ``qwen3`` (``parsers``), and ``registry`` (parsers by name, plugins of the
``kvloom.reasoning_parsers`` group too; ``docs/serving.md``, "Reasoning models")."""
