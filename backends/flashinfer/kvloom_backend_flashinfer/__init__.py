"""kvloom's FlashInfer attention backend (``FLASHINFER``).

Importing this package does not import ``flashinfer``: the declarations in
:mod:`kvloom_backend_flashinfer.backend` are enough for selection and validation, and a
missing library is reported as a validation reason naming the pip package.
"""

from kvloom_backend_flashinfer.backend import FlashInferBackend

KVLOOM_PLUGIN_API = "1.0"

__all__ = ["FlashInferBackend", "KVLOOM_PLUGIN_API"]
