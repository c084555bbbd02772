"""A shim for running the kernels under ``TRITON_INTERPRET=1`` with NumPy >= 2.4.

Triton's interpreter converts scalar tensors (held as 1-element arrays) to Python ints
with ``int(array)``; NumPy 2.4 made that a TypeError for arrays with a dimension, so any
``range()`` bound or ``if`` on a loaded value fails. This wraps the interpreter's patch of
``tl.tensor`` to use ``.item()`` instead. Only the CPU test harness calls it; GPU code
never goes through the interpreter.
"""

from __future__ import annotations

import numpy as np


def _numpy_rejects_int_of_1d_array() -> bool:
    try:
        int(np.ones(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def patch_interpreter_scalar_index() -> bool:
    """Install the shim if this NumPy needs it; returns whether it was installed."""
    if not _numpy_rejects_int_of_1d_array():
        return False
    from triton.runtime import interpreter

    if getattr(interpreter, "_kvloom_index_patched", False):
        return True
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._kvloom_index_patched = True
    return True
