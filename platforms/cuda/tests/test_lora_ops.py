"""The CUDA platform's Triton LoRA kernels (``kvloom_platform_cuda.lora_ops``) on the CPU,
in Triton's interpreter, against float64.

``TRITON_INTERPRET=1`` must be set before the kernels are defined, so they run in a child
process (this file with ``--worker``) that prints one JSON line per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = {
    # name: (num_tokens, in, out, total_rank, num_slots, padded_rows, dtype)
    "decode_mixed": (7, 64, 96, 16, 3, 0, "float32"),
    "prefill_uneven_sizes": (33, 40, 72, 24, 4, 0, "float32"),
    "wide_rank_and_padding_rows": (5, 96, 130, 80, 2, 3, "float32"),
    "half": (9, 64, 64, 16, 3, 0, "float16"),
}


def _worker() -> None:
    import torch
    from kvloom_platform_cuda.lora_ops import lora_delta_triton

    from kvloom.testing import lora_delta_reference

    results = {}
    for name, (n, k, out, rank, slots, pad, dtype_name) in CASES.items():
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(hash(name) % 1000)
        x = torch.randn(n + pad, k, generator=gen).to(dtype)
        y = torch.randn(n + pad, out, generator=gen).to(dtype)
        a = (0.3 * torch.randn(slots, rank, k, generator=gen)).to(dtype)
        b = (0.3 * torch.randn(slots, out, rank, generator=gen)).to(dtype)
        a[0] = float("nan")  # slot 0 must never be read
        b[0] = float("nan")
        token_slots = torch.randint(0, slots, (n,), generator=gen, dtype=torch.int32)
        token_slots[0] = 0
        expected = lora_delta_reference(x[:n], y[:n], a.nan_to_num(0.0), b.nan_to_num(0.0), token_slots)
        padding_before = y[n:].clone()
        actual = lora_delta_triton(x, y.clone(), a, b, token_slots)
        err = ((actual[:n].double() - expected).abs().max() / expected.abs().max()).item()
        results[name] = {
            "rel_err": err,
            "padding_untouched": bool(torch.equal(actual[n:], padding_before)),
            "base_rows_exact": bool(torch.equal(actual[:n][token_slots == 0], y[:n][token_slots == 0])),
        }
    print(json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_lora_kernel_matches_float64(results: dict, name: str) -> None:
    tol = 1e-5 if CASES[name][-1] == "float32" else 5e-3
    case = results[name]
    assert case["rel_err"] <= tol, case
    assert case["padding_untouched"] and case["base_rows_exact"], case


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
