"""The model runner's API for platforms: the memory profile (``profile_peak_memory``)
and CUDA-graph capture (``capture_cudagraphs``), driven on the CPU; platform code calls
runner methods and never reaches into the runner's fields."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.worker import model_runner
from kvloom.worker.cudagraph_dispatcher import CudagraphDispatcher
from kvloom.worker.model_runner import ModelRunner
from kvloom.platforms.worker import ModelRunnerProtocol, Worker

#: What platform code may call on a runner.
PROTOCOL_METHODS = {name for name in vars(ModelRunnerProtocol) if not name.startswith("_")}

REPO = Path(__file__).resolve().parents[2]


class RecordingMemory:
    """A stand-in for ``torch.cuda``'s allocator calls: records them, reports ``peak``."""

    def __init__(self, runner: ModelRunner, peak: int) -> None:
        self.runner, self.peak, self.calls = runner, peak, []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def empty_cache(self) -> None:
        # The temporary cache is gone before the allocator's cache is emptied.
        self.calls.append(("empty_cache", self.runner.builder is None and not self.runner.kv_caches))


def _runner() -> ModelRunner:
    config = create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=8,
                                             max_num_batched_tokens=64))  # fmt: skip
    worker = Worker(config, config.device.platform, model_runner_cls=ModelRunner)
    worker.init_device()
    worker.load_model()
    return worker.runner


def test_profile_warms_up_the_random_sample_op_for_every_variant(monkeypatch):
    """The platform's ``random_sample`` (the sampler's fast path) runs during the profile at
    one row and at the largest batch, with and without greedy rows, so no step pays its
    kernel's first compile; without the op nothing extra runs."""
    from kvloom.layers import custom_ops

    runner = _runner()
    calls = []

    def stand_in(logits, temperature, greedy):
        calls.append((logits.shape[0], temperature.shape[0], 0 if greedy is None else greedy.shape[0]))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    with monkeypatch.context() as patch:
        patch.setitem(custom_ops._active, "random_sample", stand_in)  # restored on leaving
        runner.profile_peak_memory(RecordingMemory(runner, peak=1))
    assert sorted(calls) == [(1, 1, 0), (1, 1, 1), (8, 8, 0), (8, 8, 8)]  # greedy None counted as 0
    calls.clear()
    runner.profile_peak_memory(RecordingMemory(runner, peak=1))
    assert calls == []


def test_profile_runs_the_largest_batch_on_a_one_block_cache_and_leaves_nothing(monkeypatch):
    runner = _runner()
    memory = RecordingMemory(runner, peak=12345)
    seen = {}
    forward, sampler = runner.dummy_forward, runner.sampler.sampler

    def spy_forward(num_tokens, num_reqs=None, rows_per_req=1):
        one_block = [tuple(runner.backend.get_kv_cache_shape(1, runner.block_size, a.num_kv_heads, a.head_size))
                     for a in runner.attn_layers]  # fmt: skip
        seen["forward"] = (num_tokens, num_reqs, [tuple(c.shape) for c in runner.kv_caches] == one_block,
                           runner.builder is not None)  # fmt: skip
        seen["calls_before_forward"] = list(memory.calls)
        return forward(num_tokens, num_reqs, rows_per_req)

    def spy_sampler(logits, metadata):
        seen["sampler_rows"] = logits.shape[0]
        return sampler(logits, metadata)

    monkeypatch.setattr(runner, "dummy_forward", spy_forward)
    monkeypatch.setattr(runner.sampler, "sampler", spy_sampler)
    assert runner.profile_peak_memory(memory) == 12345
    # max_num_batched_tokens tokens over max_num_seqs requests, one block per layer, a builder
    assert seen["forward"] == (64, 8, True, True)
    assert seen["sampler_rows"] == 8
    assert seen["calls_before_forward"] == ["synchronize", "reset_peak_memory_stats"]
    assert memory.calls[2:] == ["synchronize", "max_memory_allocated", ("empty_cache", True)]
    assert runner.builder is None and not runner.kv_caches
    assert all(layer.kv_cache.numel() == 0 for layer in runner.attn_layers)
    # The real cache comes next, and the runner runs on it.
    runner.initialize_kv_cache(4)
    assert runner.builder is not None and len(runner.kv_caches) == len(runner.attn_layers)
    assert torch.isfinite(runner.dummy_forward(16, 2)).all()


def test_capture_cudagraphs_installs_the_captured_graphs(monkeypatch):
    captured = []

    class FakeGraphs:
        def __init__(self, inputs, run_decode, sizes, pool):
            self.inputs, self.sizes, self.pool = inputs, sizes, pool

        def capture(self, builder):
            captured.append(self.sizes)

    runner = _runner()
    monkeypatch.setattr(model_runner, "CUDAGraphRunner", FakeGraphs)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    assert runner.cudagraphs is None
    runner.capture_cudagraphs()  # the CPU runner's dispatcher resolved NONE: nothing to capture
    assert runner.cudagraphs is None and captured == [] and not runner.dispatcher.enabled
    runner.dispatcher = CudagraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4], runner.max_num_reqs,
                                            runner.max_num_tokens)  # fmt: skip
    runner.capture_cudagraphs()
    assert captured == [[1, 2, 4]] and runner.dispatcher.enabled
    assert isinstance(runner.cudagraphs, FakeGraphs) and runner.cudagraphs.inputs is runner.inputs
    assert runner.cudagraphs.pool == "pool"


def _runner_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every ``runner.X`` / ``self.runner.X`` / ``self.model_runner.X``."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None
        if name in ("runner", "model_runner"):
            uses.append((node.lineno, node.attr))
    return uses


def test_platforms_call_runner_methods_and_touch_no_runner_field():
    """Platform code calls the runner through ``ModelRunnerProtocol`` only (kvloom's runner
    implements it)."""
    assert isinstance(_runner(), ModelRunnerProtocol)
    sources = [p for d in ("platforms", "plugins") for p in (REPO / d).rglob("*.py") if "tests" not in p.parts]
    uses = {f"{p.relative_to(REPO)}:{line}": attr for p in sources for line, attr in _runner_uses(p)}
    assert any(attr == "profile_peak_memory" for attr in uses.values())  # the scan finds the CUDA worker's calls
    bad = {where: attr for where, attr in uses.items()
           if attr.startswith("_") or attr not in PROTOCOL_METHODS}  # fmt: skip
    assert not bad, f"platform code reaches into the model runner: {bad}"
