"""The host KV cache is allocated without zero-filling (``allocate_kv_cache``): nothing may
read a slot before writing it. Every slot starts as NaN here (what uninitialised memory
may hold), and greedy tokens must still equal HF transformers' on the CPU attention
backend (CPU_ATTN, the CPU platform's only one: FLEX_ATTENTION serves CUDA), with preemption and prefix caching reusing blocks that held other requests."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model_fixtures import hf_greedy_tokens, random_prompts, tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.worker import kv_cache_memory

NEW_TOKENS = 12


def _nan_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def test_host_kv_cache_is_not_zero_filled(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(a) or torch.ones(*a, **k))
    kv_cache_memory.allocate_kv_cache((2, 3), torch.float32, torch.device("cpu"))
    assert calls == [((2, 3),)]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="plain"),
        # 10 blocks of 16 tokens cannot hold 3 requests of up to 76 tokens: preemption.
        pytest.param({"num_gpu_blocks_override": 10, "max_model_len": 96}, id="preemption"),
    ],
)
def test_greedy_parity_with_nan_filled_kv_cache(engine_kwargs, monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched allocator runs in this process
    monkeypatch.setattr(kv_cache_memory, "allocate_kv_cache", _nan_cache)
    model_dir = tiny_model_dir("llama")
    from transformers import AutoConfig

    prompts = random_prompts(AutoConfig.from_pretrained(model_dir).vocab_size, lengths=(5, 23, 64))
    expected = hf_greedy_tokens(model_dir, prompts, NEW_TOKENS)
    llm = LLM(str(model_dir), dtype="float32", attention_backend="CPU_ATTN", **engine_kwargs)
    caches = llm.llm_engine.engine_core.core.worker.runner.kv_caches
    assert bool(torch.isnan(caches[0]).any()), "the cache must start NaN-filled for this test to mean anything"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round reads prefix-cached blocks and reuses freed ones
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
