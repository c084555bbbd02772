"""FLASHINFER's CUDA cache write (``write_kv_triton``: one Triton kernel) on the CPU, in
Triton's interpreter, against the torch write (``write_kv_nhd_paired``): the same cache,
bit for bit, with padding slots (-1) left untouched and keys/values as strided views of
one fused QKV tensor, as the models pass them.

``TRITON_INTERPRET=1`` must be set before the kernels are defined and stays process-wide,
so the kernel runs in a child process (this file with ``--worker``), as in
backends/triton/tests/test_triton_backend_interpret.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {  # name: (dtype, num_tokens, kv_heads, head_size, block_size, padding tokens)
    "fp32_decode": ("float32", 5, 2, 64, 16, 3),
    "fp32_prefill_block32": ("float32", 40, 1, 128, 32, 0),
    "bf16_mixed": ("bfloat16", 23, 4, 64, 16, 2),
}


def _run_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from kvloom_backend_flashinfer import FlashInferBackend
    from kvloom_backend_flashinfer.kv_write import write_kv_nhd_paired, write_kv_triton
    from kvloom_backend_triton.interpreter_compat import patch_interpreter_scalar_index

    patch_interpreter_scalar_index()
    results = {}
    for index, (name, (dtype, n, heads, dim, bs, pad)) in enumerate(CASES.items()):
        g = torch.Generator().manual_seed(index)
        num_blocks = 8
        dt = getattr(torch, dtype)
        cache = torch.randn(FlashInferBackend.get_kv_cache_shape(num_blocks, bs, heads, dim), generator=g).to(dt)
        # q, k, v as views of one fused row, as the attention layer receives them.
        qkv = torch.randn(n, (2 * heads + 2 * heads) * dim, generator=g).to(dt)
        key = qkv[:, 2 * heads * dim : 3 * heads * dim].view(n, heads, dim)
        value = qkv[:, 3 * heads * dim :].view(n, heads, dim)
        slots = torch.randperm(num_blocks * bs, generator=g)[:n]
        slots[n - pad :] = -1
        want = cache.clone()
        write_kv_nhd_paired(want, key, value, slots)
        got = cache.clone()
        write_kv_triton(got, key, value, slots)
        written = int((got != cache).any(dim=(-1, -2)).sum())
        results[name] = {"equal": bool(torch.equal(got, want)), "written": written, "expected": 2 * (n - pad)}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, timeout=600, check=False,
                          env=env)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_write_equals_torch_write(interpreter_results: dict, case: str) -> None:
    result = interpreter_results[case]
    assert result["equal"], result
    assert result["written"] == result["expected"], result  # K and V of every real token, no padding


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
