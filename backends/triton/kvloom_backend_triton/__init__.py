"""kvloom's Triton attention backend (``TRITON_ATTN``).

Importing the package does not import Triton; the kernels load with the impl/builder.
"""

from kvloom_backend_triton.backend import KVLOOM_PLUGIN_API, TritonAttentionBackend

__all__ = ["KVLOOM_PLUGIN_API", "TritonAttentionBackend"]
