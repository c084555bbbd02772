"""Block-size negotiation between the engine and its backends, with the real FLASH_ATTN
declarations on a simulated H100 (docs/attention_backends.md).

The rule: without ``--block-size`` the backends are validated without a block size, the
first valid one in priority order is selected and decides the block size (FLASH_ATTN:
256, the smallest multiple of 256 >= 16); with ``--block-size 16`` FLASH_ATTN is invalid
with the reason naming the sizes it accepts and selection falls to the next valid
backend; a missing flash-attn is a reason naming the pip package.

The CUDA platform ranks TRITON_ATTN first below SM 10 (docs/attention_backends.md, "The
order"), so FLASH_ATTN is selected by priority only where TRITON_ATTN ranks below it: most
tests run on ``FlashAttnFirstH100``, the simulated H100 with TRITON_ATTN moved last (vLLM's
CUDA order); one checks the real order still lists and validates FLASH_ATTN. Checked through
``select_attention_backend``, through ``resolve_engine_config`` (what the engine uses,
including its log line) and through ``kvloom backends`` (all from ``kvloom.testing``).

flash-attn needs CUDA, so ``flash_attn_standin`` stands in for it where the backend must
look installed; the CUDA platform's capability is simulated (9.0, as on the H100).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Iterator

import flash_attn_standin as standin
import pytest
import torch

from tests.helpers.model_fixtures import tiny_model_dir

standin.ensure_backend_importable()

from kvloom_backend_flash_attn import FlashAttentionBackend  # noqa: E402

from kvloom.interfaces import AttentionSelectorConfig, BackendCandidate, DeviceCapability  # noqa: E402
from kvloom.testing import (  # noqa: E402
    active_platform,
    fresh_plugins,
    installed_backend,
    report_attention_backends,
    resolve_engine_config,
    run_cli,
    select_attention_backend,
)

kvloom_platform_cuda = pytest.importorskip("kvloom_platform_cuda.platform")
kvloom_backend_triton = pytest.importorskip("kvloom_backend_triton")

H100 = DeviceCapability(9, 0)
BACKENDS = (FlashAttentionBackend, kvloom_backend_triton.TritonAttentionBackend)
BLOCK_16_REASON = "block size 16 not supported (supports multiples of 256)"
MISSING_REASON = "flash_attn is not installed (pip install flash-attn)"


class SimulatedH100(kvloom_platform_cuda.CudaPlatform):
    """The CUDA platform as it reports itself on the H100 (no GPU needed)."""

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        return H100


class FlashAttnFirstH100(SimulatedH100):
    """The simulated H100 with TRITON_ATTN ranked last, so FLASH_ATTN leads the order."""

    @classmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        order = super().get_attn_backend_priority(use_mla, capability)
        return [c for c in order if c.name != "TRITON_ATTN"] + [c for c in order if c.name == "TRITON_ATTN"]


@pytest.fixture
def flash_attn_present() -> Iterator[None]:
    with standin.installed():
        yield


@pytest.fixture
def flash_attn_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "flash_attn" else real(name, *a, **k)
    )


@pytest.fixture
def registry_with_flash_attn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The installed plugins plus the FLASH_ATTN entry point (the venv does not install
    kvloom-backend-flash-attn, whose flash-attn dependency needs CUDA)."""
    for var in ("KVLOOM_PLUGINS", "KVLOOM_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    with fresh_plugins(), installed_backend(FlashAttentionBackend, distribution="kvloom-backend-flash-attn"):
        yield


def h100_config(**overrides) -> AttentionSelectorConfig:
    values = dict(head_size=128, dtype=torch.bfloat16, device_type="cuda", device_capability=H100,
                  num_heads=32, num_kv_heads=8)
    values.update(overrides)
    return AttentionSelectorConfig(**values)


# ---------------------------------------------------------------------------- selection
def test_no_block_size_selects_flash_attn_which_chooses_256(flash_attn_present) -> None:
    result = select_attention_backend(FlashAttnFirstH100, h100_config(), backends=BACKENDS)
    assert result.selected is FlashAttentionBackend
    assert result.block_size == 256
    assert result.candidates[0].name == "FLASH_ATTN" and result.candidates[0].valid


def test_the_real_h100_order_selects_triton_attn_and_still_validates_flash_attn(flash_attn_present) -> None:
    result = select_attention_backend(SimulatedH100, h100_config(), backends=BACKENDS)
    assert (result.selected.NAME, result.block_size) == ("TRITON_ATTN", 16)
    assert [(c.name, c.valid) for c in result.candidates[:2]] == [("TRITON_ATTN", True), ("FLASH_ATTN", True)]
    requested = select_attention_backend(SimulatedH100, h100_config(), requested="FLASH_ATTN", backends=BACKENDS)
    assert (requested.selected, requested.block_size) == (FlashAttentionBackend, 256)


def test_block_size_16_falls_to_the_next_valid_backend_with_the_reason(flash_attn_present) -> None:
    result = select_attention_backend(SimulatedH100, h100_config(block_size=16), backends=BACKENDS)
    reasons = {c.name: c.reasons for c in result.candidates}
    assert reasons["FLASH_ATTN"] == (BLOCK_16_REASON,)
    assert reasons["FLASHINFER"] == ("not installed (pip install kvloom-backend-flashinfer)",)
    assert result.selected.NAME == "TRITON_ATTN" and result.block_size == 16


def test_a_block_size_flash_attn_accepts_keeps_it(flash_attn_present) -> None:
    result = select_attention_backend(FlashAttnFirstH100, h100_config(block_size=512), backends=BACKENDS)
    assert (result.selected.NAME, result.block_size) == ("FLASH_ATTN", 512)


def test_missing_flash_attn_is_the_reason_and_selection_moves_on(flash_attn_missing) -> None:
    result = select_attention_backend(FlashAttnFirstH100, h100_config(), backends=BACKENDS)
    assert result.candidates[0].reasons == (MISSING_REASON,)
    assert (result.selected.NAME, result.block_size) == ("TRITON_ATTN", 16)
    # Both reasons at once when both apply.
    both = report_attention_backends(FlashAttnFirstH100, h100_config(block_size=16), backends=BACKENDS)
    assert both.candidates[0].reasons == (BLOCK_16_REASON, MISSING_REASON)


def test_requested_flash_attn_with_block_size_16_fails_with_the_reason(flash_attn_present) -> None:
    with pytest.raises(ValueError, match=r"Selected backend FLASH_ATTN is not valid for this configuration\. "
                                         r"Reasons: \['block size 16 not supported \(supports multiples of 256\)'\]"):
        select_attention_backend(
            SimulatedH100, h100_config(block_size=16), requested="FLASH_ATTN", backends=BACKENDS
        )


# ---------------------------------------------------------------------------- the engine config
def _engine_config(**args):
    # qwen3's tiny model: head size 24 (a multiple of 8), 4 heads over 2 KV heads.
    with active_platform(FlashAttnFirstH100):
        return resolve_engine_config(model=str(tiny_model_dir("qwen3")), **args)


def test_engine_config_takes_the_block_size_from_flash_attn(
    registry_with_flash_attn, flash_attn_present, caplog
) -> None:
    with caplog.at_level(logging.INFO, logger="kvloom.engine.attention_config"):
        config = _engine_config()
    assert config.attention.backend.NAME == "FLASH_ATTN"
    assert (config.cache.block_size, config.cache.user_specified_block_size) == (256, False)
    assert (
        "Block size 256 chosen by attention backend FLASH_ATTN (it supports multiples of 256); "
        "set --block-size to override." in caplog.text
    )


def test_engine_config_with_block_size_16_uses_the_next_backend(
    registry_with_flash_attn, flash_attn_present
) -> None:
    config = _engine_config(block_size=16)
    assert config.attention.backend.NAME != "FLASH_ATTN"
    assert (config.cache.block_size, config.cache.user_specified_block_size) == (16, True)
    with pytest.raises(ValueError, match=BLOCK_16_REASON.replace("(", r"\(").replace(")", r"\)")):
        _engine_config(block_size=16, attention_backend="FLASH_ATTN")


def test_engine_config_without_flash_attn_keeps_the_default_block_size(
    registry_with_flash_attn, flash_attn_missing
) -> None:
    config = _engine_config()
    assert config.attention.backend.NAME != "FLASH_ATTN"
    assert config.cache.block_size == 16


# ---------------------------------------------------------------------------- kvloom backends
@pytest.fixture
def flash_attn_first() -> Iterator[None]:
    """``kvloom backends --platform cuda`` shows ``FlashAttnFirstH100``'s table."""
    with active_platform(FlashAttnFirstH100):
        yield


def _backends_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    run_cli(["backends", "--json", "--platform", "cuda", "--device-capability", "9.0", *args])
    return json.loads(capsys.readouterr().out)


def test_kvloom_backends_shows_the_negotiated_block_size(
    registry_with_flash_attn, flash_attn_present, flash_attn_first, capsys
) -> None:
    report = _backends_json(capsys)
    assert (report["selected"], report["block_size"]) == ("FLASH_ATTN", 256)
    forced = _backends_json(capsys, "--block-size", "16")
    flash = next(c for c in forced["candidates"] if c["name"] == "FLASH_ATTN")
    assert flash["reasons"] == [BLOCK_16_REASON] and not flash["valid"]
    assert forced["selected"] not in (None, "FLASH_ATTN") and forced["block_size"] == 16

    run_cli(["backends", "--platform", "cuda", "--device-capability", "9.0"])
    table = capsys.readouterr().out
    assert "Selected: FLASH_ATTN (block size 256)" in table
    assert "Block size 256 chosen by FLASH_ATTN; set --block-size to override." in table
    run_cli(["backends", "--platform", "cuda", "--device-capability", "9.0", "--block-size", "16"])
    table = capsys.readouterr().out
    flash_row = table[table.index("FLASH_ATTN"):table.index("FLASHINFER")]  # the reason wraps in the table
    assert "invalid" in flash_row and "block size 16 not supported" in flash_row
    assert "(supports multiples of 256)" in flash_row
    assert "Selected: FLASH_ATTN" not in table and "chosen by" not in table


def test_kvloom_backends_says_flash_attn_is_missing(registry_with_flash_attn, flash_attn_missing, capsys) -> None:
    report = _backends_json(capsys)
    flash = next(c for c in report["candidates"] if c["name"] == "FLASH_ATTN")
    assert flash["reasons"] == [MISSING_REASON] and flash["distribution"] == "kvloom-backend-flash-attn"
    assert report["selected"] != "FLASH_ATTN" and report["block_size"] == 16
