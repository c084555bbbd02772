"""Structured outputs (guided decoding): grammars constrain what a request may generate.

``manager``: the engine core's ``StructuredOutputManager`` (async compilation, cache,
per-request matchers, the step's bitmask); ``backend``: the contract of a grammar library;
``xgrammar_backend``: the built-in one; ``registry``: backends by name (plugins too);
``bitmask``: applying a bitmask to the logits.
"""
