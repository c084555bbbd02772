"""torch.compile + piecewise / full CUDA graphs on a CUDA GPU (issue 19).

- fp32 parity models (tiny random Llama, Qwen3 and Qwen3-MoE: the fused_moe kernel as an opaque op), TRITON_ATTN: greedy tokens identical
  for eager (-O0), PIECEWISE and FULL_AND_PIECEWISE, with async scheduling off and on;
  the steps really ran the graphs the mode promises (the dispatcher is observed).
- FLASHINFER (bf16 only): the compiled model gives identical tokens without graphs, with
  PIECEWISE and with FULL_AND_PIECEWISE (same kernels, replayed); eager vs compiled bf16
  tokens differ by Inductor's fused rounding, so their agreement is recorded (JSON line in
  $OUT/compile_gpu.jsonl), not asserted.

Chunked prefill with a 64-token budget makes most prefill steps mixed batches (prefill
chunks next to decodes), which piecewise graphs serve up to the largest capture size 64.

Run on the device with ``bash tests/gpu/run.sh compile``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODES = {
    "eager": {"optimization_level": 0},
    "compiled": {"optimization_level": 2, "torch_compile": True, "cudagraph_mode": "NONE"},
    # the graph modes name torch_compile, whatever the platform's default
    "PIECEWISE": {"optimization_level": 1, "torch_compile": True},
    "FULL_AND_PIECEWISE": {"optimization_level": 2, "torch_compile": True},
}
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
          "kv_cache_memory": "2GiB"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the runner's dispatcher is observed
        yield


def _usable(name: str, dtype: torch.dtype) -> bool:
    from kvloom import plugins
    from kvloom.attention import selector
    from kvloom.attention.backend import AttentionSelectorConfig
    from kvloom.platforms.interface import DeviceCapability

    plugins.load_plugins()
    if name not in plugins.attention_backends():
        return False
    cfg = AttentionSelectorConfig(head_size=64, dtype=dtype, device_type="cuda",
                                  device_capability=DeviceCapability(*torch.cuda.get_device_capability()))  # fmt: skip
    return not selector.get_attention_backend(name).validate_configuration(cfg)


def _run(model: str, prompts, dtype: str, backend: str, mode: str, async_scheduling: bool):
    """Greedy tokens and the runtime modes the steps were dispatched to."""
    from kvloom import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, attention_backend=backend, async_scheduling=async_scheduling,
              **ENGINE, **MODES[mode])  # fmt: skip
    runner = llm.llm_engine.engine_core.core.worker.runner
    seen: set[str] = set()
    dispatch = runner.dispatcher.dispatch
    runner.dispatcher.dispatch = lambda n, u: (lambda r: seen.add(r[0].value) or r)(dispatch(n, u))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.shutdown()
    del llm, runner
    torch._dynamo.reset()  # drop the compiled code (and the graphs it holds) of this engine
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, seen


def _prompts(model: str) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 16, 23, 41, 64, 90)]


EXPECTED_RUNTIME = {"eager": {"NONE"}, "compiled": {"NONE"}, "PIECEWISE": {"PIECEWISE"},
                    "FULL_AND_PIECEWISE": {"FULL", "PIECEWISE"}}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "async_scheduling"), [("llama", False), ("llama", True), ("qwen3", False), ("qwen3_moe", False)]
)
def test_fp32_tokens_identical_across_modes(arch, async_scheduling):
    from tests.helpers.model_fixtures import tiny_model_dir

    if not _usable("TRITON_ATTN", torch.float32):
        pytest.skip("TRITON_ATTN not usable")
    model = str(tiny_model_dir(arch))
    prompts = _prompts(model)
    results = {m: _run(model, prompts, "float32", "TRITON_ATTN", m, async_scheduling)
               for m in ("eager", "PIECEWISE", "FULL_AND_PIECEWISE")}  # fmt: skip
    for mode, (tokens, seen) in results.items():
        assert EXPECTED_RUNTIME[mode] <= seen, (mode, seen)  # the graphs really ran
        assert tokens == results["eager"][0], mode


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_flashinfer_graph_modes_identical(tmp_path, async_scheduling):
    from kvloom.testing.models import make_tiny_model

    if not _usable("FLASHINFER", torch.bfloat16):
        pytest.skip("FLASHINFER not usable")
    # head size 64: FlashInfer serves 64, 128, 256 (the parity models have 16)
    model = str(make_tiny_model("llama", tmp_path / "llama-hd64", hidden_size=256))
    prompts = _prompts(model)
    modes = ["compiled", "PIECEWISE", "FULL_AND_PIECEWISE"] + (["eager"] if not async_scheduling else [])
    results = {m: _run(model, prompts, "bfloat16", "FLASHINFER", m, async_scheduling) for m in modes}
    for mode, (tokens, seen) in results.items():
        assert EXPECTED_RUNTIME[mode] <= seen, (mode, seen)
    compiled = results["compiled"][0]
    assert results["PIECEWISE"][0] == compiled
    assert results["FULL_AND_PIECEWISE"][0] == compiled
    if "eager" in results:  # recorded: Inductor rounds fused bf16 chains once
        eager = results["eager"][0]
        agree = sum(a == b for e, c in zip(eager, compiled) for a, b in zip(e, c)) / sum(len(e) for e in eager)
        out = Path(os.environ.get("OUT", "/tmp"))
        with open(out / "compile_gpu.jsonl", "a") as f:
            f.write(json.dumps({"test": "flashinfer_bf16_eager_vs_compiled", "position_agreement": agree}) + "\n")
