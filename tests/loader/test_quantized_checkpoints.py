"""Which quantization method runs a checkpoint (``kvloom.quantization.selection``), and the
refusals: a ``quantization_config`` no installed method reads (naming the package to
install, or saying kvloom cannot run it yet), an unknown ``--quantization``, ``none`` for
weights stored quantized, and checkpoint tensors the model does not use (an fp8
checkpoint's ``weight_scale`` when nothing reads it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

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
from kvloom.quantization.method import LayerInfo, QuantizationMethod, QuantizationSelectorConfig
from kvloom.quantization.selection import NO_QUANTIZATION, choose_method, resolve_quantization
from kvloom.testing.plugins import installed_quantization_methods
from tests.helpers.model_fixtures import make_test_engine_config, tiny_model_dir

SCALE = "model.layers.0.mlp.down_proj.weight_scale"
CPU = QuantizationSelectorConfig(device_type="cpu", dtype=torch.float32)


class ReadsFp8(QuantizationMethod):
    NAME = "stub-fp8"
    checkpoint_formats = {"fp8": ()}

    def layer_method(self, layer: LayerInfo) -> None:
        return None


class Online(QuantizationMethod):
    NAME = "stub-online"
    online = True
    supported_device_types = ("cuda",)

    def layer_method(self, layer: LayerInfo) -> None:
        return None


class Picky(ReadsFp8):
    NAME = "stub-picky"

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        if self.quantization_config.get("activation_scheme") != "dynamic":
            raise ValueError("activation_scheme must be 'dynamic'")


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


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ("fp8", "needs the package kvloom-quant-fp8 \\(pip install kvloom-quant-fp8"),
        ("compressed-tensors", "pip install kvloom-quant-compressed-tensors"),
        ("gptq", "needs the package kvloom-quant-int4 \\(pip install kvloom-quant-int4"),
        ("bitsandbytes", "'bitsandbytes' is not supported by kvloom yet"),
    ],
)
def test_a_checkpoint_no_installed_method_reads_is_refused_naming_what_to_install(tmp_path, method, says):
    model_dir = _copy_model(tmp_path / "model")
    _with_quantization_config(model_dir, {"quant_method": method, "bits": 4})
    with installed_quantization_methods(), pytest.raises(ValueError) as err:
        create_engine_config(EngineArgs(model=str(model_dir), dtype="float32"))
    assert f"quantized with '{method}'" in str(err.value) and "installed quantization methods: none" in str(err.value)
    assert re.search(says, str(err.value)), str(err.value)


def test_an_fp8_checkpoint_with_its_scales_is_refused_without_the_method(tmp_path):
    """The reported case: fp8 weights plus ``weight_scale`` tensors used to load with one warning."""
    model_dir = _copy_model(tmp_path / "model")
    _with_extra_tensor(model_dir, SCALE)
    _with_quantization_config(model_dir, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with installed_quantization_methods(), pytest.raises(ValueError, match="'fp8'.*pip install kvloom-quant-fp8"):
        create_engine_config(EngineArgs(model=str(model_dir), dtype="float32"))


def test_the_method_is_chosen_by_the_checkpoint_format_or_the_flag():
    methods = {"stub-fp8": ReadsFp8, "stub-online": Online}
    assert choose_method("fp8", None, methods) is ReadsFp8
    assert choose_method("fp8", "stub-fp8", methods) is ReadsFp8
    assert choose_method(None, "stub-online", methods) is Online
    assert choose_method(None, None, methods) is None
    assert choose_method(None, NO_QUANTIZATION, methods) is None
    assert choose_method("gguf", None, methods) is None  # no GGUF method: dequantized at load
    reads_gguf = type("ReadsGGUF", (ReadsFp8,), {"NAME": "stub-gguf", "checkpoint_formats": {"gguf": ()}})
    assert choose_method("gguf", None, {"stub-gguf": reads_gguf}) is reads_gguf
    assert choose_method("gguf", NO_QUANTIZATION, {"stub-gguf": reads_gguf}) is None
    with pytest.raises(ValueError, match="'stub-online' does not read.*allowed: stub-fp8"):
        choose_method("fp8", "stub-online", methods)
    with pytest.raises(ValueError, match="'none' cannot run a checkpoint whose weights are stored quantized"):
        choose_method("fp8", NO_QUANTIZATION, methods)
    with pytest.raises(ValueError, match="'stub-fp8' reads checkpoints quantized as fp8.*allowed: stub-online"):
        choose_method(None, "stub-fp8", methods)
    with pytest.raises(ValueError, match="several installed methods read 'fp8'.*stub-fp8, stub-picky"):
        choose_method("fp8", None, {**methods, "stub-picky": Picky})
    with pytest.raises(ValueError, match="'stub-picky' is installed but KVLOOM_PLUGINS does not list it"):
        choose_method(None, "stub-picky", methods, excluded={"stub-picky"})


def test_the_chosen_method_must_accept_the_config_and_the_platform():
    hf = type("Config", (), {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})()
    with pytest.raises(ValueError, match="'stub-picky': the checkpoint's quantization_config: activation_scheme"):
        resolve_quantization(hf, None, CPU, {"stub-picky": Picky})
    plain = type("Config", (), {})()
    with pytest.raises(ValueError, match="'stub-online' cannot run this checkpoint on the cpu platform: device type"):
        resolve_quantization(plain, "stub-online", CPU, {"stub-online": Online})
    cuda = QuantizationSelectorConfig("cuda", torch.bfloat16)
    method = resolve_quantization(plain, "stub-online", cuda, {"stub-online": Online})
    assert isinstance(method, Online) and method.quantization_config == {}


def test_a_gguf_method_that_cannot_run_here_leaves_gguf_files_dequantized(caplog):
    """GGUF files run anywhere dequantized: a GGUF method the platform cannot run (a CPU
    kernel on CUDA) is skipped with a log line, unless the user asked for it by name."""
    reads_gguf = type("CpuGGUF", (ReadsFp8,), {"NAME": "stub-gguf", "checkpoint_formats": {"gguf": ()},
                                               "supported_device_types": ("cpu",)})  # fmt: skip
    cuda = QuantizationSelectorConfig("cuda", torch.bfloat16)
    plain = type("Config", (), {})()
    with caplog.at_level("INFO", logger="kvloom.quantization.selection"):
        assert resolve_quantization(plain, None, cuda, {"stub-gguf": reads_gguf}, gguf=True) is None
    assert "GGUF weights dequantized at load; 'stub-gguf' cannot run on the cuda platform: device type" in caplog.text
    with pytest.raises(ValueError, match="'stub-gguf' cannot run this checkpoint on the cuda platform"):
        resolve_quantization(plain, "stub-gguf", cuda, {"stub-gguf": reads_gguf}, gguf=True)
    assert isinstance(resolve_quantization(plain, None, CPU, {"stub-gguf": reads_gguf}, gguf=True), reads_gguf)
    with pytest.raises(ValueError, match="'gguf' needs the package kvloom-quant-gguf"):
        choose_method("gguf", "gguf", {})


@pytest.mark.parametrize("value", ["int3", "fp16"])
def test_an_unknown_quantization_method_is_named_with_the_installed_ones(value):
    expected = rf"method '{value}' is not a quantization method kvloom knows \(installed quantization methods: stub-fp8"
    with pytest.raises(ValueError, match=expected), installed_quantization_methods(ReadsFp8):
        create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), quantization=value))


def test_quantization_none_runs_an_unquantized_checkpoint_as_stored():
    config = create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), quantization="none"))
    assert config.model.quantization is None


def test_the_cli_names_an_unknown_quantization_method(capsys):
    assert main(["generate", "--model", str(tiny_model_dir("llama")), "--quantization", "int3", "--prompt", "hi"]) != 0
    err = capsys.readouterr().err
    assert "'int3' is not a quantization method kvloom knows" in err


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


@pytest.mark.parametrize("value", ["fp8", ["fp8"], {"bits": 4}])
def test_a_malformed_quantization_config_is_an_error_naming_it(tmp_path, value):
    model_dir = _copy_model(tmp_path / "model")
    _with_quantization_config(model_dir, value)
    with pytest.raises(ValueError, match="quantization_config"):
        create_engine_config(EngineArgs(model=str(model_dir), dtype="float32"))
