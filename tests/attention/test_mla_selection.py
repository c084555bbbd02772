"""Per-phase backend selection of MLA models: a decode backend and a prefill backend,
each by the same priority-ordered validation with reasons; ``kvloom backends`` shows both.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
import torch
from kvloom_registry import PluginEntry
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom.attention.backend import AttentionSelectorConfig, MultipleOf
from kvloom.attention.mla_backend import MLAAttentionBackend
from kvloom.attention.selector import BackendSelectionError, select_attention_backend
from kvloom.entrypoints.cli.main import main
from kvloom.platforms.interface import DeviceCapability
from kvloom.plugins import ATTENTION_BACKENDS
from kvloom.testing import resolve_engine_config

kvloom_platform_cuda = pytest.importorskip("kvloom_platform_cuda.platform")
CudaPlatform = kvloom_platform_cuda.CudaPlatform
SM90 = DeviceCapability(9, 0)


class FakeMLA(MLAAttentionBackend):
    """Declarations only: selection never builds a backend."""

    NAME: ClassVar[str] = "FAKE_MLA"
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_block_sizes = (MultipleOf(1),)

    @staticmethod
    def get_impl_cls() -> Any:
        raise NotImplementedError("fake backend for selection tests")

    @staticmethod
    def get_builder_cls() -> Any:
        raise NotImplementedError("fake backend for selection tests")


def fake(name: str, phases: tuple[str, ...], **support: Any) -> type[MLAAttentionBackend]:
    return type(name, (FakeMLA,), {"NAME": name, "mla_phases": phases, **support})


FAKES = [
    fake("FLASH_ATTN_MLA", ("prefill",), min_compute_capability=DeviceCapability(9, 0),
         max_compute_capability=DeviceCapability(9, 9)),
    fake("FLASHMLA", ("decode",), supported_block_sizes=(64,)),
    fake("FLASHINFER_MLA", ("decode", "prefill"), supported_block_sizes=(32, 64)),
    fake("TRITON_MLA", ("decode", "prefill")),
]  # fmt: skip
BACKENDS = {b.NAME: PluginEntry(b.NAME, ATTENTION_BACKENDS, "kvloom-backend-mla", "0.0.test", f"fakes:{b.NAME}", b)
            for b in FAKES}  # fmt: skip


def mla_config(phase: str, capability: DeviceCapability = SM90) -> AttentionSelectorConfig:
    decode = phase == "decode"
    return AttentionSelectorConfig(
        head_size=576 if decode else 192, dtype=torch.bfloat16, use_mla=True, mla_phase=phase,
        v_head_dim=None if decode else 128, device_type="cuda", device_capability=capability,
    )  # fmt: skip


def test_the_cuda_prefill_list_and_its_order() -> None:
    names = [c.name for c in CudaPlatform.get_mla_prefill_backend_priority(SM90)]
    assert names == ["FLASH_ATTN_MLA", "FLASHINFER_MLA", "TRITON_MLA"]


def test_each_phase_takes_the_first_backend_that_implements_it() -> None:
    decode = select_attention_backend(CudaPlatform, mla_config("decode"), backends=BACKENDS)
    reasons = {c.name: c.reasons for c in decode.candidates}
    assert decode.selected.NAME == "FLASHMLA" and decode.block_size == 64
    assert reasons["FLASH_ATTN_MLA"] == ("MLA decode not supported (implements prefill)",)
    prefill = select_attention_backend(CudaPlatform, mla_config("prefill"), backends=BACKENDS)
    assert prefill.selected.NAME == "FLASH_ATTN_MLA"
    # On Ampere flash-attn's MLA prefill is out: the next one implementing prefill wins.
    ampere = select_attention_backend(CudaPlatform, mla_config("prefill", DeviceCapability(8, 0)), backends=BACKENDS)
    reasons = {c.name: c.reasons for c in ampere.candidates}
    assert ampere.selected.NAME == "FLASHINFER_MLA"
    assert reasons["FLASH_ATTN_MLA"] == ("compute capability 8.0 not supported (supports 9.0..9.9)",)


def test_a_requested_backend_without_the_phase_is_refused_with_the_reason() -> None:
    with pytest.raises(BackendSelectionError, match=r"MLA prefill not supported \(implements decode\)"):
        select_attention_backend(CudaPlatform, mla_config("prefill"), requested="FLASHMLA", backends=BACKENDS)


def test_engine_config_of_an_mla_model_has_both_backends() -> None:
    config = resolve_engine_config(model=str(tiny_model_dir("deepseek_v2")), dtype="float32")
    assert config.model.use_mla
    assert config.attention.backend.NAME == "CPU_MLA" and config.attention.prefill_backend.NAME == "CPU_MLA"
    forced = resolve_engine_config(model=str(tiny_model_dir("deepseek_v2")), dtype="float32",
                                   mla_prefill_backend="CPU_MLA", attention_backend="CPU_MLA")  # fmt: skip
    assert forced.attention.requested_prefill_backend == "CPU_MLA"


def test_a_standard_backend_cannot_serve_an_mla_phase() -> None:
    with pytest.raises(ValueError, match="MLA not supported"):
        resolve_engine_config(model=str(tiny_model_dir("deepseek_v2")), dtype="float32", mla_prefill_backend="CPU_ATTN")
    with pytest.raises(ValueError, match="MLA not supported"):
        resolve_engine_config(model=str(tiny_model_dir("deepseek_v2")), dtype="float32", attention_backend="CPU_ATTN")


def test_mla_prefill_backend_on_a_standard_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="mla_prefill_backend='CPU_MLA': model LlamaForCausalLM does not use MLA"):
        resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32", mla_prefill_backend="CPU_MLA")


def test_an_mla_backend_refuses_standard_models() -> None:
    from kvloom_backend_cpu.mla import CPUMLABackend

    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32, device_type="cpu")
    assert CPUMLABackend.validate_configuration(config) == ["only MLA models supported"]


# ---------------------------------------------------------------------- kvloom backends


@pytest.fixture
def plugins_fresh(fresh_plugins: None) -> None:
    """Every installed plugin, the default platform resolution."""


def test_backends_json_shows_both_phases_for_an_mla_model(plugins_fresh, capsys) -> None:
    code = main(["backends", "--json", "--model", str(tiny_model_dir("deepseek_v3"))])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["selected"] == "CPU_MLA" and report["prefill"]["selected"] == "CPU_MLA"
    for table in (report["candidates"], report["prefill"]["candidates"]):
        reasons = {c["name"]: c["reasons"] for c in table}
        assert reasons["CPU_MLA"] == [] and "MLA not supported" in reasons["CPU_ATTN"]


def test_backends_table_shows_both_phases(plugins_fresh, capsys) -> None:
    main(["backends", "--model", str(tiny_model_dir("deepseek_v2"))])
    out = capsys.readouterr().out
    assert "MLA decode backends (--attention-backend)" in out
    assert "MLA prefill backends (--mla-prefill-backend)" in out
    # decode over the latent row (32 + 16), prefill over decompressed heads (16 + 16, v 24)
    assert "head_size=48" in out and "mla_phase=decode" in out
    assert "head_size=32" in out and "mla_phase=prefill, v_head_size=24" in out


def test_backends_explicit_prefill_choice_that_is_invalid_fails(plugins_fresh, capsys) -> None:
    code = main(["backends", "--model", str(tiny_model_dir("deepseek_v2")), "--mla-prefill-backend", "CPU_ATTN"])
    captured = capsys.readouterr()
    assert code == 1
    assert "Selected backend CPU_ATTN is not valid" in captured.err and "MLA not supported" in captured.err


def test_backends_mla_prefill_flag_needs_mla(plugins_fresh, capsys) -> None:
    assert main(["backends", "--mla-prefill-backend", "CPU_MLA"]) == 2
    assert "not MLA" in capsys.readouterr().err
