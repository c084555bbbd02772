"""kvloom.testing's helpers for plugin authors' tests: each does what it says inside its
block and leaves the process's plugins as they were afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from kvloom_platform_cpu.platform import CpuPlatform

from kvloom import plugins, testing
from kvloom.forward_context import get_forward_context
from kvloom.interfaces import AttentionSelectorConfig
from kvloom.interfaces.models import LlamaForCausalLM
from kvloom.loader.model_loader import get_model
from tests.helpers.model_fixtures import make_test_engine_config, tiny_model_dir
from tests.helpers.reference_backend import ReferenceBackend

pytestmark = pytest.mark.usefixtures("fresh_plugins")


def _backends_json(capsys: pytest.CaptureFixture[str]) -> dict:
    assert testing.run_cli(["backends", "--json", "--platform", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_installed_backend_is_seen_inside_the_block_only(capsys: pytest.CaptureFixture[str]) -> None:
    before = _backends_json(capsys)
    assert "TEST_REFERENCE" not in [c["name"] for c in before["candidates"]]
    with testing.installed_backend(ReferenceBackend, distribution="my-backend", version="1.2") as backend:
        assert backend is ReferenceBackend
        assert plugins.attention_backends()["TEST_REFERENCE"].target is ReferenceBackend
        (row,) = [c for c in _backends_json(capsys)["candidates"] if c["name"] == "TEST_REFERENCE"]
        assert (row["distribution"], row["version"], row["valid"]) == ("my-backend", "1.2", True)
        config = testing.resolve_engine_config(model=str(tiny_model_dir("llama")), attention_backend="TEST_REFERENCE")
        assert config.attention.backend is ReferenceBackend
    assert _backends_json(capsys) == before


def test_installed_backend_names_its_distribution_by_default() -> None:
    with testing.installed_backend(ReferenceBackend):
        assert plugins.attention_backends()["TEST_REFERENCE"].distribution == "tests"


def test_active_platform_is_the_engines_platform_inside_the_block() -> None:
    class SimulatedCpu(CpuPlatform):
        pass

    model = str(tiny_model_dir("llama"))
    real = testing.resolve_engine_config(model=model).device.platform
    with testing.active_platform(SimulatedCpu):
        assert testing.resolve_engine_config(model=model).device.platform is SimulatedCpu
        assert plugins.platforms()["cpu"].target is SimulatedCpu
    assert testing.resolve_engine_config(model=model).device.platform is real
    assert plugins.platforms()["cpu"].target is CpuPlatform


def test_fresh_plugins_reloads_under_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "CPU_ATTN" in plugins.attention_backends()
    monkeypatch.setenv("KVLOOM_PLUGINS", "cpu")
    with testing.fresh_plugins():
        assert "CPU_ATTN" not in plugins.attention_backends()
    monkeypatch.delenv("KVLOOM_PLUGINS")
    assert "CPU_ATTN" in plugins.attention_backends()


def test_selection_among_given_backend_classes() -> None:
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32, device_type="cpu")
    result = testing.select_attention_backend(CpuPlatform, config, backends=[ReferenceBackend])
    assert (result.selected, result.block_size) == (ReferenceBackend, 16)
    assert [c.name for c in result.candidates if c.valid] == ["TEST_REFERENCE"]
    report = testing.report_attention_backends(CpuPlatform, config, "NOPE", backends=[ReferenceBackend])
    assert report.selected is None and "Unknown attention backend 'NOPE'" in report.error
    with pytest.raises(ValueError, match="Unknown attention backend 'NOPE'"):
        testing.select_attention_backend(CpuPlatform, config, "NOPE", backends=[ReferenceBackend])


def test_load_model_builds_and_loads_as_the_engine_does() -> None:
    config = make_test_engine_config(tiny_model_dir("llama"))
    ours = testing.load_model(LlamaForCausalLM, config)
    engines = get_model(config, "cpu")
    assert not ours.training
    theirs = dict(engines.named_parameters())
    for name, param in ours.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, theirs[name]), name


def test_forward_context_holds_the_metadata_for_the_block() -> None:
    with testing.forward_context("metadata", lora="mapping"):
        assert get_forward_context().attn_metadata == "metadata"
        assert get_forward_context().extras == {"lora": "mapping"}
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_lora_delta_reference_adds_each_tokens_adapter() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2, 4)
    a = torch.stack([torch.zeros(1, 3), torch.ones(1, 3)])  # slot 0: no adapter
    b = torch.stack([torch.zeros(4, 1), torch.full((4, 1), 2.0)])
    out = testing.lora_delta_reference(x, y, a, b, torch.tensor([0, 1]))
    assert out.dtype == torch.float64 and out.tolist() == [[0.0] * 4, [6.0] * 4]
