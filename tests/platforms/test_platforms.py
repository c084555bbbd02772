"""Platform resolution rules and the built-in CPU and CUDA platforms."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.interfaces import BackendCandidate, Platform
from kvloom.platforms.resolution import PlatformResolutionError, resolve_platform
from kvloom.plugins import PLATFORM_PLUGINS
from kvloom_registry import PluginEntry, PluginLoadError

CpuPlatform = pytest.importorskip("kvloom_platform_cpu.platform").CpuPlatform
CudaPlatform = pytest.importorskip("kvloom_platform_cuda.platform").CudaPlatform


def fake_platform(name: str, *, builtin: bool, available: bool, device_type: str = "cpu") -> type[Platform]:
    def is_available(cls: type) -> bool:
        return available

    def priority(cls: type, use_mla: bool, capability: Any) -> list[BackendCandidate]:
        return []

    def worker(cls: type) -> type:
        raise NotImplementedError("resolution tests never build a worker")

    return type(
        name,
        (Platform,),
        {
            "name": name,
            "device_type": device_type,
            "builtin": builtin,
            "is_available": classmethod(is_available),
            "get_attn_backend_priority": classmethod(priority),
            "get_worker_cls": classmethod(worker),
        },
    )


def entries(*platforms: type[Platform]) -> dict[str, PluginEntry]:
    return {
        p.name: PluginEntry(p.name, PLATFORM_PLUGINS, f"dist-{p.name}", "1.0", f"fake:{p.name}", p) for p in platforms
    }


CPU = fake_platform("cpu", builtin=True, available=True)
GPU = fake_platform("gpu", builtin=True, available=True, device_type="cuda")
GPU_ABSENT = fake_platform("gpu", builtin=True, available=False, device_type="cuda")
OOT = fake_platform("oot", builtin=False, available=True)
OOT2 = fake_platform("oot2", builtin=False, available=True)
OOT_ABSENT = fake_platform("oot_absent", builtin=False, available=False)


def test_out_of_tree_platform_wins_over_builtin() -> None:
    assert resolve_platform(entries(CPU, GPU, OOT)).target is OOT


def test_unavailable_out_of_tree_platform_is_ignored() -> None:
    assert resolve_platform(entries(CPU, OOT_ABSENT)).target is CPU


def test_accelerator_wins_over_host_cpu() -> None:
    assert resolve_platform(entries(CPU, GPU)).target is GPU
    assert resolve_platform(entries(CPU, GPU_ABSENT)).target is CPU


def test_two_available_out_of_tree_platforms_is_an_error_naming_both() -> None:
    with pytest.raises(PlatformResolutionError) as e:
        resolve_platform(entries(CPU, OOT, OOT2))
    assert "oot (dist-oot 1.0)" in str(e.value) and "oot2 (dist-oot2 1.0)" in str(e.value)
    assert "KVLOOM_PLATFORM" in str(e.value)


def test_kvloom_platform_forces_one() -> None:
    assert resolve_platform(entries(CPU, OOT, OOT2), forced="cpu").target is CPU
    assert resolve_platform(entries(CPU, OOT, OOT2), forced="oot2").target is OOT2


def test_forced_platform_must_be_installed_and_available() -> None:
    with pytest.raises(PlatformResolutionError, match="KVLOOM_PLATFORM=tpu: no installed plugin provides it. Loaded platforms: cpu, oot."):
        resolve_platform(entries(CPU, OOT), forced="tpu")
    with pytest.raises(PlatformResolutionError, match=r"KVLOOM_PLATFORM=gpu: platform gpu .* is_available\(\) returned False"):
        resolve_platform(entries(CPU, GPU_ABSENT), forced="gpu")
    excluded = list(entries(OOT).values())
    with pytest.raises(PlatformResolutionError, match="installed but KVLOOM_PLUGINS does not list it"):
        resolve_platform(entries(CPU), forced="oot", excluded=excluded)


def test_no_available_platform_mentions_kvloom_plugins() -> None:
    with pytest.raises(PlatformResolutionError) as e:
        resolve_platform({}, excluded=list(entries(CPU, GPU).values()))
    assert "No kvloom platform is available" in str(e.value)
    assert "KVLOOM_PLUGINS leaves out the installed platform plugins cpu, gpu" in str(e.value)
    with pytest.raises(PlatformResolutionError, match="none available here: gpu"):
        resolve_platform(entries(GPU_ABSENT))


def test_crashing_is_available_is_a_plugin_error() -> None:
    class Crashing(fake_platform("crashing", builtin=False, available=True)):  # type: ignore[misc]
        @classmethod
        def is_available(cls) -> bool:
            raise OSError("driver library missing")

    with pytest.raises(PluginLoadError, match="crashing.*driver library missing"):
        resolve_platform(entries(CPU, Crashing))


class SleepyCpu(fake_platform("sleepy_cpu", builtin=False, available=False)):  # type: ignore[misc]
    """A CPU-based out-of-tree platform that is off until configured, and says so."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "SLEEPY_CPU_THREADS is not set"


def test_unavailable_platform_is_reported_by_its_is_available_and_reason() -> None:
    """Not "no cpu device" (there is one): the platform's is_available() said no, and why."""
    with pytest.raises(PlatformResolutionError) as e:
        resolve_platform(entries(CPU, SleepyCpu), forced="sleepy_cpu")
    assert str(e.value) == (
        "KVLOOM_PLATFORM=sleepy_cpu: platform sleepy_cpu (dist-sleepy_cpu 1.0) is installed, but its "
        "is_available() returned False: SLEEPY_CPU_THREADS is not set."
    )
    assert "device" not in str(e.value)
    # Without a reason (the default unavailable_reason() is None), the message ends there.
    assert Platform.unavailable_reason() is None
    with pytest.raises(PlatformResolutionError, match=r"is installed, but its is_available\(\) returned False\.$"):
        resolve_platform(entries(CPU, OOT_ABSENT), forced="oot_absent")
    with pytest.raises(PlatformResolutionError) as e:
        resolve_platform(entries(SleepyCpu, GPU_ABSENT))
    assert "none available here: sleepy_cpu (dist-sleepy_cpu 1.0: SLEEPY_CPU_THREADS is not set), gpu (dist-gpu 1.0)" in str(e.value)


def test_crashing_unavailable_reason_is_a_plugin_error() -> None:
    class Crashing(SleepyCpu):
        @classmethod
        def unavailable_reason(cls) -> str | None:
            raise OSError("cannot read the device table")

    with pytest.raises(PluginLoadError, match="unavailable_reason.*cannot read the device table"):
        resolve_platform(entries(CPU, Crashing), forced="sleepy_cpu")


def test_engine_startup_line_names_the_device(fresh_plugins: None, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.config_builder import create_engine_config
    from tests.helpers.model_fixtures import tiny_model_dir

    monkeypatch.setenv("KVLOOM_PLATFORM", "cpu")
    monkeypatch.setattr(CpuPlatform, "get_device_name", classmethod(lambda cls, device_id=0: "Test CPU 9000"))
    with caplog.at_level("INFO", logger="kvloom.engine.config_builder"):
        create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), dtype="float32"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvloom config:")]
    assert "platform=cpu device=Test CPU 9000 " in line

# ---------------------------------------------------------------------- built-in platforms


def test_cpu_platform_declarations() -> None:
    assert (CpuPlatform.name, CpuPlatform.device_type, CpuPlatform.builtin) == ("cpu", "cpu", True)
    assert CpuPlatform.supported_dtypes[0] == torch.float32
    assert set(CpuPlatform.supported_dtypes) == {torch.float32, torch.bfloat16, torch.float16}
    assert CpuPlatform.is_available() and not CpuPlatform.supports_cuda_graphs
    assert CpuPlatform.get_attn_backend_priority(False, None)[0] == BackendCandidate("CPU_ATTN", "kvloom-backend-cpu")
    assert CpuPlatform.get_device_capability() is None
    assert CpuPlatform.device() == torch.device("cpu")


def _engine_config_on(platform: type[Platform], monkeypatch: pytest.MonkeyPatch, **args: Any) -> Any:
    from kvloom import plugins
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.config_builder import create_engine_config
    from tests.helpers.model_fixtures import tiny_model_dir

    monkeypatch.setattr(plugins, "current_platform", lambda: platform)
    return create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), dtype="float32", **args))


def test_supports_cuda_graphs_decides_whether_graphs_run(fresh_plugins: None, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A platform that does not declare ``supports_cuda_graphs`` (the default, False) runs
    eagerly whatever the mode, without a check_and_update_config of its own."""

    class NoGraphs(CpuPlatform):  # type: ignore[misc, valid-type]
        name = "no_graphs"
        builtin = False

        @classmethod
        def check_and_update_config(cls, config: Any) -> None:
            pass

    class WithGraphs(NoGraphs):
        name = "with_graphs"
        supports_cuda_graphs = True
        compile_by_default = True

    assert Platform.supports_cuda_graphs is False and NoGraphs.supports_cuda_graphs is False
    with caplog.at_level("INFO", logger="kvloom.engine.compile_config"):
        config = _engine_config_on(NoGraphs, monkeypatch, cudagraph_mode="FULL")
    assert config.compilation.cudagraph_mode == CUDAGraphMode.NONE
    assert "cudagraph_mode FULL -> NONE: the platform has no CUDA graphs" in caplog.text
    # With graphs: the CPU_ATTN backend declares NEVER, so only the piecewise part remains
    # (docs/cuda_graphs.md; every combination: tests/compilation/test_dispatcher.py).
    assert _engine_config_on(WithGraphs, monkeypatch, cudagraph_mode="FULL").compilation.cudagraph_mode == "PIECEWISE"
    assert _engine_config_on(WithGraphs, monkeypatch).compilation.cudagraph_mode == CUDAGraphMode.PIECEWISE
    # The built-in CPU platform gets its eager mode from its declaration too.
    assert _engine_config_on(CpuPlatform, monkeypatch, cudagraph_mode="FULL").compilation.cudagraph_mode == "NONE"


def test_cuda_platform_declarations() -> None:
    assert (CudaPlatform.name, CudaPlatform.device_type, CudaPlatform.builtin) == ("cuda", "cuda", True)
    assert CudaPlatform.supported_dtypes == (torch.bfloat16, torch.float16, torch.float32)
    assert CudaPlatform.supports_cuda_graphs
    assert CudaPlatform.is_available() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert CudaPlatform.get_device_capability() is None
    else:
        major, minor = torch.cuda.get_device_capability()
        assert tuple(CudaPlatform.get_device_capability()) == (major, minor)
