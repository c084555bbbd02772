"""The backend conformance suite on the GPU, for every installed CUDA attention backend."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "backend", ["TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "FLASH_ATTN", "TRITON_MLA", "FLASHINFER_MLA"]
)
def test_conformance_on_cuda(backend):
    from kvloom import plugins
    from kvloom.testing import run_conformance

    plugins.load_plugins()
    if backend not in plugins.attention_backends():
        pytest.skip(f"{backend} is not installed")
    report = run_conformance(backend, device="cuda")
    print(report.format())
    assert report.passed, report.format()
