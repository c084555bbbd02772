"""Structured-output backends by name: the built-in ``xgrammar`` and plugins of the
``kvloom.structured_output_backends`` entry-point group (``docs/structured_outputs.md``)."""

from __future__ import annotations

from kvloom.sampling_params import StructuredOutputsParams
from kvloom.structured_output.backend import StructuredOutputBackend

#: The backend used when none is named.
DEFAULT_BACKEND = "xgrammar"


def available_backends() -> dict[str, type[StructuredOutputBackend]]:
    """Backend name -> class: the built-in one and the loaded plugins."""
    from kvloom import plugins
    from kvloom.structured_output.xgrammar_backend import XgrammarBackend

    return plugins.structured_output_backends({XgrammarBackend.name: XgrammarBackend})


def get_backend_cls(name: str) -> type[StructuredOutputBackend]:
    from kvloom import plugins

    return plugins.pick_by_name(available_backends(), name, "structured_outputs_backend", "backend")


def validate_structured_outputs(params: StructuredOutputsParams, backend: str = DEFAULT_BACKEND) -> None:
    """Raise ``ValueError`` naming the problem if ``params`` cannot be compiled."""
    get_backend_cls(backend).validate(params)
