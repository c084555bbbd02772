"""Tool-call parsers: ``base`` (the contract), the built-in ``hermes`` and ``llama3_json``,
and ``registry`` (parsers by name, plugins of the ``kvloom.tool_parsers`` group too;
``docs/structured_outputs.md``)."""
