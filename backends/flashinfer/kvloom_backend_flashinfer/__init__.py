"""kvloom's FlashInfer attention backends (``FLASHINFER``, and ``FLASHINFER_MLA`` for MLA decode).

Importing this package does not import ``flashinfer``: the declarations in
:mod:`kvloom_backend_flashinfer.backend` are enough for selection and validation, and a
missing library is reported as a validation reason naming the pip package.
"""

from kvloom_backend_flashinfer.backend import FlashInferBackend
from kvloom_backend_flashinfer.mla_backend import FlashInferMLABackend

KVLOOM_PLUGIN_API = "1.0"

__all__ = ["FlashInferBackend", "FlashInferMLABackend", "KVLOOM_PLUGIN_API"]
