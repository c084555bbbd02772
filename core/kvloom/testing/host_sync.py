"""Detect host synchronisations in code that must be capturable in a CUDA graph.

Works on the CPU too: a host sync shows up as the ``aten._local_scalar_dense`` op (what
``.item()``, ``int(tensor)``, ``bool(tensor)`` and indexing with a 0-dim tensor dispatch
to), so code that is meant to stay on the device can be checked where no GPU exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default}


class HostSyncError(AssertionError):
    pass


class _SyncDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _SYNC_OPS:
            raise HostSyncError(f"host synchronisation ({func}) in code that must stay on the device")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise ``HostSyncError`` if the block reads a tensor value back to the host."""
    with _SyncDetector():
        yield
