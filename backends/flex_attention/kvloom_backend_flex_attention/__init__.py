"""kvloom's FlexAttention backend (``FLEX_ATTENTION``): paged attention in plain torch."""

from kvloom_backend_flex_attention.backend import FlexAttentionBackend

KVLOOM_PLUGIN_API = "1.0"

__all__ = ["FlexAttentionBackend", "KVLOOM_PLUGIN_API"]
