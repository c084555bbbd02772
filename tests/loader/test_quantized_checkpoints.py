"""Quantized checkpoints are refused at load instead of generating wrong tokens (issue 18,
item 1): a ``quantization_config`` kvloom does not run, ``--quantization``, and checkpoint
tensors the model does not use (an fp8 checkpoint's ``weight_scale``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.entrypoints.cli.main import main
from kvloom.loader.model_loader import get_model
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.registry import ModelRegistry
from kvloom.models.weights import UnusedCheckpointTensorsError
from tests.helpers.model_fixtures import make_test_engine_config, tiny_model_dir

SCALE = "model.layers.0.mlp.down_proj.weight_scale"


def _copy_model(dst: Path) -> Path:
    shutil.copytree(tiny_model_dir("llama"), dst)
    return dst


def _with_quantization_config(model_dir: Path, quantization_config: dict) -> None:
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = quantization_config
    config_file.write_text(json.dumps(config))


def _with_extra_tensor(model_dir: Path, name: str) -> Path:
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    weights[name] = torch.ones(1)
    save_file(weights, path)
    return path


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "bitsandbytes", "compressed-tensors"])
def test_a_quantization_config_is_refused_naming_the_method(tmp_path, method):
    model_dir = _copy_model(tmp_path / "model")
    _with_quantization_config(model_dir, {"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=rf"quantized with '{method}'.*kvloom does not support yet"):
        create_engine_config(EngineArgs(model=str(model_dir), dtype="float32"))


def test_an_fp8_checkpoint_with_its_scales_is_refused(tmp_path):
    """The reported case: fp8 weights plus ``weight_scale`` tensors used to load with one warning."""
    model_dir = _copy_model(tmp_path / "model")
    _with_extra_tensor(model_dir, SCALE)
    _with_quantization_config(model_dir, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match="'fp8'.*not support yet"):
        create_engine_config(EngineArgs(model=str(model_dir), dtype="float32"))


def test_unused_checkpoint_tensors_are_an_error_naming_them_and_the_file(tmp_path):
    model_dir = _copy_model(tmp_path / "model")
    weight_file = _with_extra_tensor(model_dir, SCALE)
    with pytest.raises(UnusedCheckpointTensorsError) as err:
        get_model(make_test_engine_config(model_dir), "cpu")
    assert err.value.names == [SCALE]
    assert SCALE in str(err.value) and str(weight_file) in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)


def test_rotary_buffers_stay_ignorable_by_default(tmp_path):
    model_dir = _copy_model(tmp_path / "model")
    _with_extra_tensor(model_dir, "model.layers.0.self_attn.rotary_emb.inv_freq")
    get_model(make_test_engine_config(model_dir), "cpu")


def test_a_model_class_may_declare_tensors_ignorable(tmp_path, monkeypatch):
    class ScaleIgnoringModel(LlamaForCausalLM):
        ignored_checkpoint_tensors = ("*.weight_scale",)

    model_dir = _copy_model(tmp_path / "model")
    _with_extra_tensor(model_dir, SCALE)
    monkeypatch.setitem(ModelRegistry._models, "ScaleIgnoringForCausalLM", ScaleIgnoringModel)
    config = make_test_engine_config(model_dir)
    config.model.architecture = "ScaleIgnoringForCausalLM"
    assert isinstance(get_model(config, "cpu"), ScaleIgnoringModel)
    # Its patterns replace the default: an inv_freq buffer is now unused.
    _with_extra_tensor(model_dir, "model.layers.0.self_attn.rotary_emb.inv_freq")
    with pytest.raises(UnusedCheckpointTensorsError, match="inv_freq"):
        get_model(config, "cpu")


@pytest.mark.parametrize("method", ["fp8", "awq", "gguf", "bitsandbytes"])
def test_the_quantization_flag_is_refused_as_not_supported_yet(method):
    with pytest.raises(ValueError, match=f"quantization '{method}' is not supported by kvloom yet"):
        EngineArgs(quantization=method)
    assert EngineArgs(quantization=None).quantization is None


def test_an_unknown_quantization_method_is_named(capsys):
    with pytest.raises(ValueError, match="'int3' is not a quantization method"):
        EngineArgs(quantization="int3")


def test_the_cli_refuses_the_quantization_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir("llama")), "--quantization", "fp8"])
    err = capsys.readouterr().err
    assert "--quantization" in err and "not supported by kvloom yet" in err
