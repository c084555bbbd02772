"""KVLOOM_CPROFILE_DIR: each kvloom process writes its cProfile when it stops."""

from __future__ import annotations

import pstats
from pathlib import Path

import pytest

from kvloom import LLM, EngineArgs, SamplingParams
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.core_lifecycle import prestart_engine_core_server
from kvloom.profiling import CPROFILE_DIR_ENV, cprofile_if_asked
from tests.helpers.model_fixtures import tiny_model_dir


def test_nothing_is_profiled_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPROFILE_DIR_ENV, raising=False)
    with cprofile_if_asked("api_server", 3):
        sum(range(1000))
    assert not list(tmp_path.iterdir())


def test_the_block_is_profiled_however_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPROFILE_DIR_ENV, str(tmp_path))

    def marker_function() -> None:
        raise SystemExit(0)  # as SIGTERM ends the engine core's busy loop

    with pytest.raises(SystemExit), cprofile_if_asked("api_server", 3):
        marker_function()
    (prof,) = tmp_path.glob("api_server_3_*.prof")
    assert any(name == "marker_function" for _, _, name in pstats.Stats(str(prof)).stats)


def test_a_directory_that_does_not_exist_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPROFILE_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=CPROFILE_DIR_ENV), cprofile_if_asked("api_server"):
        pass


def test_the_engine_core_process_writes_its_busy_loop_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(tiny_model_dir("llama"))
    # The fork server of the engine cores (on the CPU) already runs, started before the
    # variable was set (as by an earlier engine of this process): the engine core still
    # sees the variable, as it is when the engine starts.
    prestart_engine_core_server(create_engine_config(EngineArgs(model=model, dtype="float32")))
    monkeypatch.setenv(CPROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(model, dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.llm_engine.shutdown()
    (prof,) = tmp_path.glob("engine_core_0_*.prof")
    functions = {name for _, _, name in pstats.Stats(str(prof)).stats}
    assert {"run_busy_loop", "step"} <= functions
