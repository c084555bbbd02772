"""-O levels, --enforce-eager and explicit flags -> the compilation section
(``resolve_compilation``), for a CUDA-like and a CPU-like platform."""

from __future__ import annotations

import pytest

from kvloom.attention.backend import AttentionCGSupport
from kvloom.cudagraph_mode import CUDAGraphMode as M
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.compile_config import _default_capture_sizes, resolve_compilation


class GraphPlatform:
    name = "cuda-like"
    supports_cuda_graphs = True
    compile_by_default = True


class HostPlatform:
    name = "cpu-like"
    supports_cuda_graphs = False
    compile_by_default = False


def _backend(support: AttentionCGSupport, splitting_ops: tuple[str, ...] = ()) -> type:
    return type("Backend", (), {"cudagraph_support": support, "splitting_ops": splitting_ops})


UNIFORM = _backend(AttentionCGSupport.UNIFORM_BATCH)


def _resolve(platform=GraphPlatform, backend=UNIFORM, **kw):
    return resolve_compilation(EngineArgs(model="m", **kw), platform, backend, max_num_batched_tokens=8192)


@pytest.mark.parametrize(
    ("level", "compiled", "mode"),
    [(0, False, M.NONE), (1, True, M.PIECEWISE), (2, True, M.FULL_AND_PIECEWISE), (3, True, M.FULL_AND_PIECEWISE)],
)
def test_level_defaults(level, compiled, mode):
    c = _resolve(optimization_level=level)
    assert (c.compile_model, c.cudagraph_mode, c.optimization_level) == (compiled, mode, level)
    assert c.custom_ops == ("none" if compiled else "all")  # Inductor fuses the layer math itself
    assert c.splitting_ops == ["kvloom::unified_attention"]


def test_default_level_is_2():
    assert EngineArgs(model="m").optimization_level == 2


@pytest.mark.parametrize(
    ("kw", "compiled", "mode"),
    [
        ({"enforce_eager": True}, False, M.NONE),
        ({"enforce_eager": True, "torch_compile": True}, True, M.NONE),  # explicit compile wins
        ({"enforce_eager": True, "cudagraph_mode": M.PIECEWISE}, False, M.NONE),  # eager: no graphs
        ({"optimization_level": 0, "torch_compile": True}, True, M.NONE),
        ({"optimization_level": 0, "cudagraph_mode": M.FULL_DECODE_ONLY}, False, M.FULL_DECODE_ONLY),
        ({"optimization_level": 1, "cudagraph_mode": M.FULL_AND_PIECEWISE}, True, M.FULL_AND_PIECEWISE),
        ({"torch_compile": False}, False, M.FULL_DECODE_ONLY),  # no piecewise graphs without compile
        ({"cudagraph_mode": M.FULL}, True, M.FULL_AND_PIECEWISE),
        ({"cudagraph_mode": M.NONE}, True, M.NONE),
    ],
)
def test_explicit_flags_win(kw, compiled, mode):
    c = _resolve(**kw)
    assert (c.compile_model, c.cudagraph_mode) == (compiled, mode)


def test_backend_support_downgrades_and_declares_splitting_ops():
    never = _backend(AttentionCGSupport.NEVER, ("mylib::graph_unsafe",))
    c = _resolve(backend=never)
    assert c.cudagraph_mode == M.PIECEWISE  # attention runs between the pieces
    assert c.splitting_ops == ["kvloom::unified_attention", "mylib::graph_unsafe"]
    assert _resolve(backend=never, torch_compile=False).cudagraph_mode == M.NONE


def test_cpu_like_platform_stays_eager_unless_asked():
    c = _resolve(platform=HostPlatform)
    assert (c.compile_model, c.cudagraph_mode, c.custom_ops) == (False, M.NONE, "all")
    c = _resolve(platform=HostPlatform, torch_compile=True, optimization_level=1)
    assert (c.compile_model, c.cudagraph_mode) == (True, M.NONE)
    assert _resolve(platform=HostPlatform, torch_compile=True, custom_ops="all").custom_ops == "all"
    assert _resolve(torch_compile=True, use_inductor=False).custom_ops == "all"  # no Inductor to fuse


def test_lora_turns_compile_off_or_refuses_explicit_compile():
    assert _resolve(enable_lora=True).compile_model is False
    with pytest.raises(ValueError, match="enable_lora"):
        _resolve(enable_lora=True, torch_compile=True)


def test_capture_sizes():
    assert _default_capture_sizes(256, None, 8192) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert _default_capture_sizes(4, None, 8192) == [1, 2, 4, 8]  # 2 x max_num_seqs
    assert _default_capture_sizes(256, 600, 8192)[-2:] == [592, 600]
    assert _default_capture_sizes(256, None, 100)[-1] == 100  # at most max_num_batched_tokens
    assert _resolve(cudagraph_capture_sizes=[1, 64, 576, 9000]).cudagraph_capture_sizes == [1, 64, 576]
