"""The Triton-interpreter run that kernel tests share (the CUDA platform's, the
quantization methods'): each test file runs its cases in one fresh process (``python
<file> --worker``, which sets ``TRITON_INTERPRET=1`` before the kernels are defined,
records each case with ``record_case`` and ends with ``print_results``), so the
interpreter never leaks into the test process, and the parent's tests read the results
(``interpreter_results``), one test per case. ``patch_bf16_rounding`` makes the
interpreter's float32 -> bfloat16 cast round as compiled Triton does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

RESULTS_PREFIX = "RESULTS "


def interpreter_results(test_file: str, timeout: float) -> dict:
    """Run ``test_file --worker`` without the caller's ``TRITON_INTERPRET`` and return the
    JSON of its last ``RESULTS`` line; a failed or silent worker fails with its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(test_file), "--worker"], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULTS_PREFIX)]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix(RESULTS_PREFIX))


def record_case(results: dict, name: str, case: Callable[[], dict]) -> None:
    """In the worker: ``results[name] = case()``, or ``{"error": "<type>: <message>"}`` when
    it raises, so one failing case does not hide the others (the parent fails that case's
    test with the message)."""
    try:
        results[name] = case()
    except Exception as exc:  # reported per case by the parent
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}


def print_results(results: dict) -> None:
    """In the worker, last: the line ``interpreter_results`` reads."""
    print(RESULTS_PREFIX + json.dumps(results), flush=True)


def patch_bf16_rounding() -> None:
    """In the worker: make the interpreter's fp32 -> bf16 cast round to nearest even, as
    compiled Triton does (the interpreter truncates). NaN/inf are not handled."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            lsb = (bits >> np.uint32(16)) & np.uint32(1)
            rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def patch_fp8_rounding() -> None:
    """In the worker: make the interpreter's fp32 -> fp8 (e4m3) cast round as the GPU does
    (its own drops the carry of a mantissa that rounds up into the next power of two:
    124.3 -> 64 instead of 128). The conversion is torch's, round to nearest even."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes, tl.float8e4nv)
        return original(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
