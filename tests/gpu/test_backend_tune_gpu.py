"""``kvloom backends tune`` on a CUDA GPU: every valid backend of a tiny Llama's attention
is timed (decode steps in full CUDA graphs where the backend supports them, a mixed step),
the result is cached, and the engine then selects the fastest. Run with
``bash tests/gpu/run.sh tests``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tune_times_every_valid_backend_and_the_engine_picks_the_fastest(tmp_path, monkeypatch, capsys) -> None:
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.config_builder import create_engine_config
    from kvloom.entrypoints.cli.main import main
    from kvloom.testing.models import tiny_model_dir

    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    model = str(tiny_model_dir("llama"))
    before = create_engine_config(EngineArgs(model=model, dtype="bfloat16")).attention.backend.NAME
    assert main(["backends", "tune", model, "--dtype", "bfloat16", "--iters", "5", "--json"]) == 0
    tune = json.loads(capsys.readouterr().out)
    assert Path(tune["path"]).is_file()
    measured = {b["name"]: b for b in tune["backends"]}
    assert "TRITON_ATTN" in measured and before in measured
    for b in measured.values():
        assert b["error"] is None, b
        assert len(b["times_ms"]) == 5 and all(t > 0 for t in b["times_ms"].values())
    fastest = min(measured, key=lambda name: sum(measured[name]["times_ms"].values()))
    assert create_engine_config(EngineArgs(model=model, dtype="bfloat16")).attention.backend.NAME == fastest
    # An explicit backend stays.
    explicit = EngineArgs(model=model, dtype="bfloat16", attention_backend="TRITON_ATTN")
    assert create_engine_config(explicit).attention.backend.NAME == "TRITON_ATTN"
