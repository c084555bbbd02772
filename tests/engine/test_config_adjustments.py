"""What a platform's ``check_and_update_config`` and the general plugins'
``kvloom_update_engine_config`` may change in the resolved ``EngineConfig``: the sections
are pydantic models validated on assignment; budgets and limits may change (the engine
runs with them, as the startup line shows); the model, the selected backend and the
platform may not, and a block size or KV-cache dtype the selected backend cannot serve is
refused with the backend's reasons; the errors name who changed what."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from kvloom import plugins
from kvloom.interfaces import EngineConfig
from kvloom.testing import active_platform, resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir

CpuPlatform = pytest.importorskip("kvloom_platform_cpu.platform").CpuPlatform

pytestmark = pytest.mark.usefixtures("fresh_plugins")


def resolved_with(adjust: Callable[[EngineConfig], None], where: str = "platform", **args: Any) -> EngineConfig:
    """The config of the tiny Llama with ``adjust`` run as the platform's
    check_and_update_config, or as a general plugin's hook (``where="hook"``)."""

    class Adjusting(CpuPlatform):  # type: ignore[misc, valid-type]
        @classmethod
        def check_and_update_config(cls, config: EngineConfig) -> None:
            if where == "platform":
                adjust(config)

    original = plugins.call_update_engine_config

    def hooks(config: EngineConfig) -> None:
        original(config)
        if where == "hook":
            adjust(config)

    with active_platform(Adjusting), pytest.MonkeyPatch.context() as mp:
        mp.setattr(plugins, "call_update_engine_config", hooks)
        return resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32", **args)


@pytest.mark.parametrize("where", ["platform", "hook"])
def test_budgets_and_limits_may_change(where: str, caplog: pytest.LogCaptureFixture) -> None:
    def adjust(config: EngineConfig) -> None:
        config.scheduler.max_num_seqs = 4
        config.scheduler.max_num_batched_tokens = 64
        config.model.max_model_len = config.scheduler.max_model_len = 128  # both, and lower
        config.cache.kv_cache_memory = 32 * 2**20
        config.cache.enable_prefix_caching = False
        config.cache.block_size = 32  # CPU_ATTN serves it
        config.compilation.custom_ops = "none"
        config.observability.log_stats_interval = 0.5

    with caplog.at_level("INFO", logger="kvloom.engine.config_builder"):
        config = resolved_with(adjust, where)
    assert (config.scheduler.max_num_seqs, config.model.max_model_len, config.cache.block_size) == (4, 128, 32)
    assert "max_model_len=128" in caplog.text and "block_size=32" in caplog.text  # the line shows the result


def test_sections_validate_assignments() -> None:
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32")
    with pytest.raises(ValidationError, match="max_num_seqs"):
        config.scheduler.max_num_seqs = "many"  # type: ignore[assignment]
    with pytest.raises(ValidationError, match="max_num_seqs"):
        config.scheduler.max_num_seqs = 0
    with pytest.raises(ValidationError, match="block_size"):
        config.cache.block_size = 0
    with pytest.raises(ValidationError, match="custom_ops"):
        config.compilation.custom_ops = "some"  # type: ignore[assignment]


FORBIDDEN = {
    "model.dtype": lambda c: setattr(c.model, "dtype", torch.float16),
    "model.architecture": lambda c: setattr(c.model, "architecture", "MistralForCausalLM"),
    "model.hf_config": lambda c: setattr(c.model, "hf_config", None),
    "attention.backend": lambda c: setattr(c.attention, "backend", type("Other", (c.attention.backend,), {})),
    "device.platform": lambda c: setattr(c.device, "platform", CpuPlatform),
    "device.device_type": lambda c: setattr(c.device, "device_type", "cuda"),
}


@pytest.mark.parametrize("where", ["platform", "hook"])
@pytest.mark.parametrize("field", list(FORBIDDEN))
def test_the_model_backend_and_platform_may_not_change(field: str, where: str) -> None:
    who = "check_and_update_config of platform cpu" if where == "platform" else "kvloom_update_engine_config"
    with pytest.raises(ValueError, match=rf"{who}.* changed {field}, which must not change"):
        resolved_with(FORBIDDEN[field], where)


def test_max_model_len_changes_in_both_sections_and_only_down() -> None:
    with pytest.raises(ValueError, match="model.max_model_len .* scheduler.max_model_len .* must be equal"):
        resolved_with(lambda c: setattr(c.model, "max_model_len", 64))
    with pytest.raises(ValueError, match="max_model_len 512 exceeds the model's maximum of 256"):
        resolved_with(lambda c: (setattr(c.model, "max_model_len", 512), setattr(c.scheduler, "max_model_len", 512)))


@pytest.mark.parametrize("where", ["platform", "hook"])
def test_what_the_backend_cannot_serve_is_refused(where: str) -> None:
    def adjust(config: EngineConfig) -> None:
        config.cache.cache_dtype = "float16"  # CPU_ATTN's cache is the model dtype ("auto") only

    with pytest.raises(ValueError, match=r"attention backend CPU_ATTN cannot serve the adjusted config: .*float16"):
        resolved_with(adjust, where)


def test_the_startup_line_names_the_served_model(caplog: pytest.LogCaptureFixture) -> None:
    model = str(tiny_model_dir("llama"))
    with caplog.at_level("INFO", logger="kvloom.engine.config_builder"):
        # vLLM's rule: the model argument exactly as given.
        assert resolve_engine_config(model=model, dtype="float32").model.served_model_name == model
        resolve_engine_config(model=model, dtype="float32", served_model_name="my-alias")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvloom config:")]
    assert [line.split()[2:4] for line in lines] == [
        ["model=llama", f"served_model_name={model}"], ["model=llama", "served_model_name=my-alias"]
    ]  # fmt: skip
