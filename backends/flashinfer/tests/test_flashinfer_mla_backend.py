"""CPU tests of FLASHINFER_MLA (flashinfer is not installed here): declarations, validation
reasons, the phase it implements, and that the declarations import no flashinfer. Its
kernels run in the GPU tests (test_flashinfer_mla_gpu.py, tests/gpu/test_mla_gpu.py); its
host planning is planning.plan_paged_kv, covered by test_flashinfer_backend.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import kvloom_backend_flashinfer  # noqa: F401
except ImportError:  # the venv script skips installing this package: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom_backend_flashinfer import FlashInferMLABackend

from kvloom.interfaces import AttentionCGSupport, AttentionSelectorConfig, DeviceCapability

H100 = DeviceCapability(9, 0)


def _config(**overrides: object) -> AttentionSelectorConfig:
    base = dict(head_size=576, dtype=torch.bfloat16, block_size=64, device_type="cuda", device_capability=H100,
                num_heads=16, num_kv_heads=1, use_mla=True, mla_phase="decode")
    base.update(overrides)
    return AttentionSelectorConfig(**base)  # type: ignore[arg-type]


def _flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def test_declarations() -> None:
    assert FlashInferMLABackend.NAME == "FLASHINFER_MLA"
    assert FlashInferMLABackend.is_mla and FlashInferMLABackend.mla_phases == ("decode",)
    assert FlashInferMLABackend.cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert FlashInferMLABackend.get_kv_cache_shape(7, 64, 1, 576) == (7, 64, 576)
    assert FlashInferMLABackend.required_modules == {"flashinfer": "flashinfer-python"}


def test_valid_decode_on_hopper_when_flashinfer_is_there() -> None:
    reasons = FlashInferMLABackend.validate_configuration(_config())
    expected = [] if _flashinfer_importable() else ["flashinfer is not installed (pip install flashinfer-python)"]
    assert reasons == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"mla_phase": "prefill", "head_size": 192}, "MLA prefill not supported (implements decode)"),
        ({"head_size": 48}, "head size 48 not supported (supports 576)"),
        ({"dtype": torch.float32}, "dtype float32 not supported"),
        ({"block_size": 1}, "block size 1 not supported (supports 16, 32, 64)"),
        ({"use_mla": False, "mla_phase": None, "head_size": 128}, "only MLA models"),
        ({"device_capability": DeviceCapability(7, 5)}, "compute capability"),
    ],
)
def test_invalid_configurations_name_the_reason(overrides: dict, expected: str) -> None:
    reasons = FlashInferMLABackend.validate_configuration(_config(**overrides))
    assert any(expected in r for r in reasons), reasons


def test_importing_the_backend_does_not_import_flashinfer() -> None:
    code = (
        "import sys; sys.path.insert(0, %r); import kvloom_backend_flashinfer as m; "
        "m.FlashInferMLABackend.validate_configuration; print('flashinfer' in sys.modules)"
    ) % str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
