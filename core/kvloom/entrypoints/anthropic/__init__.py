"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), which
Claude-style clients and coding assistants speak: ``protocol`` (the bodies and their
conversion to chat messages) and ``serving_messages`` (the router, over chat)."""
