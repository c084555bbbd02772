"""kvloom's FlashAttention attention backend (``FLASH_ATTN``).

Importing this package does not import ``flash_attn``: the declarations in
:mod:`kvloom_backend_flash_attn.backend` are enough for selection and validation, and a
missing library is the reason "flash_attn is not installed (pip install flash-attn)".
The kernels are imported with the impl (``FlashAttentionBackend.get_impl_cls()``).
"""

from kvloom_backend_flash_attn.backend import KVLOOM_PLUGIN_API, FlashAttentionBackend

__all__ = ["FlashAttentionBackend", "KVLOOM_PLUGIN_API"]
