"""The CUDA worker on a real GPU (``gpu`` marker, skipped without CUDA): the memory
profile the model runner runs (``profile_peak_memory``) sizes the KV cache, the CUDA
graphs it captures (``capture_cudagraphs``) are replayed for decode steps and give the
eager run's tokens, and LoRA steps run the platform's Triton ``lora_delta`` op (fp32: with
the torch code's tokens).

Run on the device: ``python -m pytest platforms/cuda/tests/test_cuda_worker_gpu.py``
(after ``bash tests/gpu/run.sh setup``, with ``PYTHONPATH=/tmp/site``)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers.model_fixtures import random_prompts, tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY_TOKENS = 16


def _generate(llm, prompts, lora_request=None) -> list[list[int]]:
    from kvloom import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora_request,
                        use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _free(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_profiled_cache_and_captured_graphs_give_the_eager_tokens(monkeypatch):
    from kvloom import LLM
    from kvloom.testing import ModelRunner

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spies and the runner live in this process
    peaks = []
    profile = ModelRunner.profile_peak_memory
    monkeypatch.setattr(ModelRunner, "profile_peak_memory", lambda self, memory: peaks.append(profile(self, memory))
                        or peaks[-1])  # fmt: skip
    model = str(tiny_model_dir("llama"))
    prompts = random_prompts(500)[:4]
    llm = LLM(model, dtype="float32", attention_backend="TRITON_ATTN", gpu_memory_utilization=0.3,
              cudagraph_capture_sizes=[1, 2, 4, 8])  # fmt: skip
    runner = llm.llm_engine.engine_core.core.worker.runner
    assert len(peaks) == 1 and peaks[0] > 0  # the profile ran, on the device
    assert llm.config.cache.num_blocks > 0 and runner.builder is not None
    assert all(c.shape == runner.kv_caches[0].shape for c in runner.kv_caches) and runner.kv_caches[0].is_cuda
    graphs = runner.cudagraphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replays = []
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda size, b: replays.append(b) or replay(size, b))
    with_graphs = _generate(llm, prompts)
    assert replays and max(replays) == len(prompts)  # decode steps replayed the graphs
    _free(llm)
    eager = LLM(model, dtype="float32", attention_backend="TRITON_ATTN", kv_cache_memory="1GiB", enforce_eager=True)
    assert eager.llm_engine.engine_core.core.worker.runner.cudagraphs is None
    assert _generate(eager, prompts) == with_graphs
    _free(eager)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_steps_run_the_triton_op_with_the_torch_codes_tokens(tmp_path, monkeypatch, dtype):
    from kvloom_platform_cuda import lora_ops

    from kvloom import LLM, LoRARequest
    from tests.helpers.lora_fixtures import make_adapter

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    calls = []
    kernel = lora_ops.lora_delta
    monkeypatch.setattr(lora_ops, "lora_delta", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    base = tiny_model_dir("llama")
    adapter = LoRARequest("a1", 1, str(make_adapter(base, tmp_path / "a1", seed=1, r=8)))
    prompts = random_prompts(500)[:3]
    tokens = {}
    for custom_ops in ("all", "none"):
        llm = LLM(str(base), dtype=dtype, attention_backend="TRITON_ATTN", kv_cache_memory="1GiB", enable_lora=True,
                  max_loras=1, max_lora_rank=8, custom_ops=custom_ops)  # fmt: skip
        tokens[custom_ops] = _generate(llm, prompts, [adapter, None, adapter])
        _free(llm)
        if custom_ops == "all":
            assert calls  # the Triton kernel ran
            calls.clear()
    assert not calls  # --custom-ops none: the grouped torch GEMMs
    assert all(len(t) == GREEDY_TOKENS for t in tokens["all"])
    if dtype == "float32":
        assert tokens["all"] == tokens["none"]
    # bf16: the kernel sums in another order than the GEMMs, and greedy runs of the tiny
    # random model part ways after a few tokens (measured on an H100: 23 of 48 agree).


def test_filling_in_flight_input_tokens_does_not_wait_for_the_stream(monkeypatch):
    """Async scheduling prepares step n+1 while step n runs: the copy of the tokens step n
    samples into n+1's inputs (``_fill_placeholders``) must be queued behind it, not wait
    for the stream (a blocking host->device copy synchronises it)."""
    import time

    import numpy as np

    from kvloom import LLM

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the runner lives in this process
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", attention_backend="TRITON_ATTN", kv_cache_memory="1GiB",
              enforce_eager=True, async_scheduling=True)  # fmt: skip
    runner = llm.llm_engine.engine_core.core.worker.runner
    # Requests "a" and "b" in input-batch rows 3 and 5 sampled rows 2 and 0 of the step in flight.
    runner.inputs.record_sampled(torch.tensor([7, 8, 9], device="cuda"), np.array([3, 5]), [2, 0])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time: the step in flight
    start = time.perf_counter()
    runner.inputs._fill_placeholders(np.array([0, 1]), np.array([0, 1]), ["a", "b"], np.array([3, 5]))
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    assert elapsed < 0.2, f"_fill_placeholders waited {elapsed:.2f} s for the stream"
    assert runner.inputs.input_ids[:2].tolist() == [9, 7]
    _free(llm)
