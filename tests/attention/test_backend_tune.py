"""``kvloom backends tune``: the cache of measured backend times (its key and files), and
selection ordered by it, on the CPU with fake timings (the command itself times CUDA
kernels). The step timer runs once on the CPU (CPU_ATTN) as a smoke test of its plumbing."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from kvloom.attention.backend import AttentionSelectorConfig
from kvloom.attention.selector import BackendSelectionError, report_attention_backends, select_attention_backend
from kvloom.attention.tuning import (
    STEP_CASES,
    BackendTimes,
    BackendTune,
    StepCase,
    TuneKey,
    find_tune,
    load_tune,
    run_tune,
    save_tune,
    tune_path,
)
from kvloom.entrypoints.cli.main import main
from tests.attention.test_selector import SM80, SM90, STANDARD_FAKES, CudaPlatform, cuda_config, entries
from tests.helpers.model_fixtures import tiny_model_dir


class FakeGPU(CudaPlatform):
    """The CUDA platform with an H100 present (selection only; nothing runs on it)."""

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    return tmp_path


def llama_8b_config(**overrides: object) -> AttentionSelectorConfig:
    return cuda_config(SM90, **{"num_heads": 32, "num_kv_heads": 8, **overrides})


#: Fake step times (ms per step of 10 layers) per backend: FLASHINFER fastest, then FLASH_ATTN.
FAKE_MS = {"FLASHINFER": 1.0, "FLASH_ATTN": 2.0, "TRITON_ATTN": 3.0, "FLEX_ATTENTION": 9.0}


def fake_timer(calls: list | None = None):
    def time_step(backend, config, case: StepCase, num_layers: int) -> float:
        if calls is not None:
            calls.append((backend.NAME, config.block_size, case.name, num_layers))
        if backend.NAME == "FLEX_ATTENTION" and case.name.startswith("mixed"):
            raise RuntimeError("out of shared memory")
        return FAKE_MS[backend.NAME] * num_layers / 10 * len(case.query_lens) ** 0.5

    return time_step


def make_tune(config: AttentionSelectorConfig, calls: list | None = None) -> BackendTune:
    key = TuneKey.of(FakeGPU, config)
    assert key is not None
    return run_tune(key, config, STANDARD_FAKES, fake_timer(calls), num_layers=10, model="llama-8b")


def test_the_key_names_everything_a_tune_depends_on() -> None:
    config = llama_8b_config()
    key = TuneKey.of(FakeGPU, config)
    assert key is not None
    assert (key.device_name, key.capability, key.head_size, key.num_heads, key.num_kv_heads) == (
        "NVIDIA H100 80GB HBM3", "9.0", 128, 32, 8)  # fmt: skip
    assert (key.dtype, key.kv_cache_dtype, key.block_size) == ("bfloat16", "auto", None)
    # Every field changes the file; the same key always gives the same file.
    variants = [llama_8b_config(head_size=64), llama_8b_config(num_kv_heads=4), llama_8b_config(dtype=torch.float16),
                llama_8b_config(kv_cache_dtype="fp8"), llama_8b_config(block_size=32),
                llama_8b_config(device_capability=SM80)]  # fmt: skip
    names = {TuneKey.of(FakeGPU, v).file_name() for v in variants} | {key.file_name()}  # type: ignore[union-attr]
    assert len(names) == len(variants) + 1
    assert TuneKey.of(FakeGPU, llama_8b_config()).file_name() == key.file_name()
    assert dataclasses.replace(key, kvloom_version="9.9").file_name() != key.file_name()
    # No key: heads unknown, MLA, or the device absent.
    assert TuneKey.of(FakeGPU, cuda_config(SM90)) is None
    assert TuneKey.of(FakeGPU, llama_8b_config(use_mla=True)) is None
    assert TuneKey.of(CudaPlatform, llama_8b_config()) is None or torch.cuda.is_available()


def test_run_tune_times_every_case_and_keeps_failures(cache_dir: Path) -> None:
    calls: list = []
    tune = make_tune(llama_8b_config(), calls)
    # Each backend at its preferred block size (the key's is None), every case, the model's layers.
    assert {(name, case) for name, _, case, _ in calls} >= {("TRITON_ATTN", c.name) for c in STEP_CASES}
    assert all(block == 16 and layers == 10 for _, block, _, layers in calls)
    flex = next(b for b in tune.backends if b.name == "FLEX_ATTENTION")
    assert flex.error == "RuntimeError: out of shared memory" and flex.total_ms is None
    assert tune.fastest_first() == ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"]
    expected = sum(FAKE_MS["TRITON_ATTN"] * len(c.query_lens) ** 0.5 for c in STEP_CASES)
    assert tune.total_ms("TRITON_ATTN") == pytest.approx(expected)
    # Cached under $KVLOOM_CACHE_DIR/backend_tune, read back equal.
    path = save_tune(tune)
    assert path == tune_path(tune.key) and path.parent == cache_dir / "backend_tune"
    assert load_tune(tune.key) == tune
    assert find_tune(FakeGPU, llama_8b_config()) == tune
    assert find_tune(FakeGPU, llama_8b_config(num_kv_heads=4)) is None  # another key: no tune


def test_a_broken_or_foreign_cache_file_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    tune = make_tune(llama_8b_config())
    path = save_tune(tune)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvloom.attention.tuning"):
        assert load_tune(tune.key) is None
    assert f"Ignoring the backend tune {path}" in caplog.text
    other = dataclasses.replace(tune.key, num_heads=64)
    path.write_text(json.dumps(dataclasses.replace(tune, key=other).to_json()))
    with caplog.at_level(logging.WARNING, logger="kvloom.attention.tuning"):
        assert load_tune(tune.key) is None
    assert "it was made for" in caplog.text


def test_selection_orders_the_valid_candidates_by_the_tune() -> None:
    config = llama_8b_config()
    backends = entries(*STANDARD_FAKES)
    assert select_attention_backend(FakeGPU, config, backends=backends).selected.NAME == "TRITON_ATTN"  # platform
    tune = make_tune(config)
    result = select_attention_backend(FakeGPU, config, backends=backends, tune=tune)
    assert result.selected.NAME == "FLASHINFER" and result.tune is tune
    assert [(c.priority, c.name) for c in result.candidates] == [
        (1, "FLASHINFER"), (2, "FLASH_ATTN"), (3, "TRITON_ATTN"), (4, "FLEX_ATTENTION")]  # fmt: skip
    assert [c.measured_ms is not None for c in result.candidates] == [True, True, True, False]
    # An explicit backend is never overridden; an invalid one is still an error.
    assert select_attention_backend(FakeGPU, config, "TRITON_ATTN", backends=backends, tune=tune).selected.NAME == (
        "TRITON_ATTN")  # fmt: skip
    with pytest.raises(BackendSelectionError, match="Selected backend FLASHINFER is not valid"):
        select_attention_backend(FakeGPU, llama_8b_config(head_size=96), "FLASHINFER", backends=backends, tune=tune)
    # A measured backend that is not valid now does not move up: float32 leaves TRITON_ATTN.
    fp32 = select_attention_backend(FakeGPU, llama_8b_config(dtype=torch.float32), backends=backends, tune=tune)
    assert fp32.selected.NAME == "TRITON_ATTN"
    assert [c.name for c in fp32.candidates] == ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]
    report = report_attention_backends(FakeGPU, config, backends=backends, tune=tune).to_json()
    assert report["order"] == "tune" and report["tune_created"] == tune.created
    assert report["candidates"][0]["measured_ms"] == pytest.approx(tune.total_ms("FLASHINFER"))


def test_the_engine_and_kvloom_backends_use_the_cached_tune(caplog: pytest.LogCaptureFixture,
                                                          capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    """On the CPU (one valid backend, so the order cannot change): a tune cached for the
    tiny model's key is what the engine's selection and ``kvloom backends`` report."""
    from kvloom import plugins
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.config_builder import create_engine_config
    from kvloom.entrypoints.cli.backends_tune import format_tune

    model = str(tiny_model_dir("llama"))
    plugins.load_plugins()
    platform = plugins.current_platform()
    args = EngineArgs(model=model, dtype="float32")
    config = create_engine_config(args)
    from kvloom.engine.attention_config import selector_config

    selector = selector_config(platform, config.model, "auto", None)
    key = TuneKey.of(platform, selector)
    assert key is not None and key.device_name == platform.get_device_name()
    tune = BackendTune(key, [BackendTimes("CPU_ATTN", 16, {"decode 1": 0.5, "mixed 64+512": 2.0})], 2, "2026-12-01")
    save_tune(tune)
    with caplog.at_level(logging.INFO, logger="kvloom.engine.attention_config"):
        assert create_engine_config(args).attention.backend.NAME == "CPU_ATTN"
    assert "Attention backend CPU_ATTN: the fastest valid one measured by `kvloom backends tune`" in caplog.text
    assert "CPU_ATTN 2.500 ms" in caplog.text
    assert main(["backends", "--model", model, "--dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["order"] == "tune" and data["candidates"][0]["measured_ms"] == 2.5
    assert main(["backends", "--model", model, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Measured ms" in out and "Order: measured by `kvloom backends tune`" in out
    assert "CPU_ATTN" in format_tune(tune) and "Fastest: CPU_ATTN" in format_tune(tune)


def test_tune_command_needs_a_gpu_and_caches_what_it_measures(capsys: pytest.CaptureFixture, cache_dir: Path) -> None:
    import argparse

    from kvloom import plugins
    from kvloom.attention.tune_timing import step_time
    from kvloom.entrypoints.cli.backends import build_selector_config
    from kvloom.entrypoints.cli.backends_tune import tune_and_report

    model = str(tiny_model_dir("llama"))
    if not torch.cuda.is_available():
        assert main(["backends", "tune", model]) == 2
        assert "kvloom backends tune times attention kernels on a CUDA GPU" in capsys.readouterr().err
        assert not (cache_dir / "backend_tune").exists()
    # The command's work with the real step timer, eagerly on the CPU on one small case.
    plugins.load_plugins()
    args = argparse.Namespace(model=model, dtype="float32", kv_cache_dtype="auto", block_size=None, head_size=None,
                              use_mla=False, device_capability=None, json=True)  # fmt: skip
    small = StepCase("mixed 2+8", (1, 1, 8), (20, 33, 24), False)

    def on_the_cpu(backend, config, case, num_layers):
        return step_time(backend, config, small, num_layers, torch.device("cpu"), warmup=1, iters=2)

    platform = plugins.current_platform()
    assert tune_and_report(args, platform, build_selector_config(args, platform), on_the_cpu) == 0
    result = json.loads(capsys.readouterr().out)
    (times,) = result["backends"]
    assert times["name"] == "CPU_ATTN" and times["error"] is None and all(t > 0 for t in times["times_ms"].values())
    assert Path(result["path"]).is_file() and result["num_layers"] == 2
