"""The compile cache's directory and key; the CUDA-graph wrapper's CPU-visible parts
(pass-through outside its runtime mode, non-owning output views). Capture and replay
are CUDA-only: tests/gpu/test_compile_gpu.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tests.helpers.model_fixtures import make_test_engine_config, tiny_model_dir

import kvloom
from kvloom.compilation import cache
from kvloom.compilation.cuda_graph import CUDAGraphWrapper, weak_ref_tensor
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.forward_context import BatchDescriptor, set_forward_context


@pytest.fixture
def config():
    return make_test_engine_config(tiny_model_dir("llama"))


def test_cache_dir_under_kvloom_cache_dir(monkeypatch, tmp_path, config):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = cache.use_compile_cache(config)
    assert path == tmp_path / "torch_compile" / cache.compile_cache_key(config) and path.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton")


def test_cache_key(monkeypatch, tmp_path, config):
    key = cache.compile_cache_key(config)
    assert key == cache.compile_cache_key(make_test_engine_config(tiny_model_dir("llama")))  # deterministic
    # the same checkpoint in another directory compiles the same
    copy = shutil.copytree(tiny_model_dir("llama"), tmp_path / "elsewhere")
    assert cache.compile_cache_key(make_test_engine_config(copy)) == key
    # what the generated code depends on changes the key
    assert cache.compile_cache_key(make_test_engine_config(tiny_model_dir("qwen2"))) != key
    assert cache.compile_cache_key(make_test_engine_config(tiny_model_dir("llama"), dtype=torch.bfloat16)) != key
    changed = make_test_engine_config(tiny_model_dir("llama"))
    changed.compilation.use_inductor = False
    assert cache.compile_cache_key(changed) != key
    same = make_test_engine_config(tiny_model_dir("llama"))
    same.compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE  # graphs wrap the same compiled pieces
    assert cache.compile_cache_key(same) == key
    monkeypatch.setattr(kvloom, "__version__", "999")
    assert cache.compile_cache_key(config) != key


def test_wrapper_runs_the_callable_outside_its_mode():
    calls = []
    wrapper = CUDAGraphWrapper(lambda x: calls.append(x) or x + 1, CUDAGraphMode.PIECEWISE, pool=None)
    assert wrapper(1) == 2  # no forward context
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL):  # FULL: inside a full graph's capture
        with set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(4, False)):
            assert wrapper(2) == 3
    with set_forward_context(None, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE):  # no key: no graph
        assert wrapper(3) == 4
    assert calls == [1, 2, 2, 3] and wrapper.entries == {}
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        CUDAGraphWrapper(lambda: None, CUDAGraphMode.FULL_AND_PIECEWISE, pool=None)


def test_weak_ref_tensor_views_the_memory():
    t = torch.arange(12.0).view(3, 4)
    view = weak_ref_tensor(t[1:])
    assert view.shape == (2, 4) and view.data_ptr() == t[1:].data_ptr()
    t[1, 0] = -1.0
    assert view[0, 0] == -1.0


def test_wrapper_captures_once_per_key_then_replays(monkeypatch):
    """The wrapper's bookkeeping with a stand-in for CUDA graphs (the capture context runs
    the callable; a replay only counts): one capture per descriptor, replays return the
    captured outputs' memory, and a moved input is an error."""
    replays = []

    class FakeGraph:
        def replay(self):
            replays.append(self)

    class FakeCapture:
        def __init__(self, graph, pool=None):
            self.pool = pool

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    calls = []
    wrapper = CUDAGraphWrapper(lambda x: calls.append(1) or (x * 2, x.shape[0]), CUDAGraphMode.PIECEWISE, pool="p")
    x4, x8 = torch.ones(4), torch.ones(8)
    for key, x in ((BatchDescriptor(4, False), x4), (BatchDescriptor(8, False), x8)):
        with set_forward_context(None, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=key):
            captured, n = wrapper(x)  # capture
            replayed, n2 = wrapper(x)  # replay
        assert (n, n2) == (x.shape[0], x.shape[0])
        assert replayed.data_ptr() == captured.data_ptr() and torch.equal(replayed, captured)
    assert len(calls) == 2 and len(replays) == 2 and set(wrapper.entries) == {BatchDescriptor(4, False),
                                                                               BatchDescriptor(8, False)}  # fmt: skip
    with set_forward_context(None, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                             batch_descriptor=BatchDescriptor(4, False)):  # fmt: skip
        with pytest.raises(RuntimeError, match="not at their captured addresses"):
            wrapper(torch.ones(4))
