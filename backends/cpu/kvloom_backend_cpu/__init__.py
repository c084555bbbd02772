"""kvloom's CPU attention backend (``CPU_ATTN``)."""

from kvloom_backend_cpu.backend import CPUAttentionBackend

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["CPUAttentionBackend", "KVLOOM_PLUGIN_API"]
