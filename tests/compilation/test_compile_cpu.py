"""torch.compile through kvloom's piecewise backend on the CPU (Inductor's C++ backend):
the graph is split at every attention call, one compile serves every batch size, and
greedy fp32 tokens are identical to eager for -O0, -O1 and -O2. CUDA graphs do not
exist here (tests/gpu/test_compile_gpu.py covers them)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model_fixtures import random_prompts, tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.compilation.backend import op_name

# Prompt lengths give prefill steps of many sizes; the single prompt gives 1-token decode
# steps (a size Dynamo specialises unless its size guard is dropped), the four prompts
# 4-token ones.
PROMPTS = random_prompts(500, lengths=(5, 16, 23, 41))
PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


def _run(single: bool = True, **kwargs) -> tuple[list[list[int]], LLM]:
    """Tokens of the four prompts, then (``single``) of the first alone: its 1-token decode
    steps run the graph compiled for larger steps."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=8, **kwargs)
    tokens = _generate(llm, PROMPTS) + (_generate(llm, PROMPTS[:1]) if single else [])
    return tokens, llm


@pytest.fixture(scope="module")
def eager_tokens():
    tokens, llm = _run(optimization_level=0)
    assert llm.llm_engine.engine_core.core.worker.runner.compile_backend is None
    return tokens


@pytest.fixture(scope="module", autouse=True)
def _in_process_and_own_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the runner is inspected
        mp.setenv("KVLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("kvloom-cache")))
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each engine adds compiled versions of the model's forward to Dynamo's per-code cache
    # (8 at most, then it runs eagerly): start every test from an empty cache.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_split_at_attention_and_one_compile_for_all_sizes(eager_tokens):
    # Without Inductor (fast): the structure and the tokens.
    tokens, llm = _run(optimization_level=1, torch_compile=True, use_inductor=False)
    runner = llm.llm_engine.engine_core.core.worker.runner
    backend = runner.compile_backend
    split = backend.last_split
    num_layers = len(runner.attn_layers)
    assert len(split.splitting) == num_layers and len(split.pieces) == num_layers + 1
    assert split.order[1::2] == split.splitting  # attention between every two pieces
    # The split module calls them as functions, in that order (no nn.Module calls).
    calls = [n.target.__name__ for n in split.module.graph.nodes if n.op == "call_function" and
             n.target.__name__.startswith("submod_")]  # fmt: skip
    assert calls == split.order and not any(n.op == "call_module" for n in split.module.graph.nodes)
    for name in split.splitting:
        calls = [n for n in split.module.get_submodule(name).graph.nodes if n.op == "call_function"]
        assert [op_name(n.target) for n in calls] == ["kvloom::unified_attention"]
    for name in split.pieces:  # the pieces hold no attention
        nodes = split.module.get_submodule(name).source.graph.nodes  # the FX piece behind the compiled one
        assert all(op_name(n.target) != "kvloom::unified_attention" for n in nodes if n.op == "call_function")
    # Steps of many token counts ran, one token included: one graph for all of them.
    assert backend.stats.graphs == 1, backend.stats
    assert tokens == eager_tokens


def test_split_module_calls_attention_without_the_dispatcher(eager_tokens, monkeypatch):
    """Between two pieces the split module calls the attention op's Python implementation
    directly (kvloom.compilation.backend._direct_attention), once per layer and step."""
    import kvloom.compilation.backend as backend_module

    direct = []
    real = backend_module.unified_attention
    monkeypatch.setattr(backend_module, "unified_attention", lambda *a: direct.append(a[-1]) or real(*a))
    tokens, llm = _run(single=False, optimization_level=1, torch_compile=True, use_inductor=False)
    names = [layer.prefix for layer in llm.llm_engine.engine_core.core.worker.runner.attn_layers]
    assert tokens == eager_tokens[: len(PROMPTS)]
    assert direct and len(direct) % len(names) == 0 and direct[: len(names)] == names


@pytest.mark.parametrize("level", [1, 2])
def test_inductor_tokens_identical_to_eager(eager_tokens, level):
    tokens, llm = _run(optimization_level=level, torch_compile=True)
    backend = llm.llm_engine.engine_core.core.worker.runner.compile_backend
    assert backend is not None and backend.use_inductor and backend.stats.graphs == 1
    assert llm.config.compilation.custom_ops == "none"
    assert tokens == eager_tokens


def test_padded_piecewise_steps_keep_the_tokens(eager_tokens):
    """The runner's PIECEWISE step path without graphs (CPU): inputs padded to a capture
    size, attention on the real rows only (``num_actual_tokens``), the real rows of the
    hidden states kept. Tokens and prompt logprobs are those of unpadded steps."""
    from kvloom.cudagraph_mode import CUDAGraphMode
    from kvloom.worker.cudagraph_dispatcher import CudagraphDispatcher

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=8, optimization_level=1,
              torch_compile=True, use_inductor=False)  # fmt: skip
    runner = llm.llm_engine.engine_core.core.worker.runner
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)
    reference = llm.generate([{"prompt_token_ids": PROMPTS[0]}], with_logprobs, use_tqdm=False)
    dispatcher = CudagraphDispatcher(CUDAGraphMode.PIECEWISE, [8, 64, 128], runner.max_num_reqs,
                                     runner.max_num_tokens)  # fmt: skip
    dispatcher.enabled = True  # nothing to capture on the CPU: the wrappers are not there
    seen = []
    def dispatch(n: int, uniform_decode: bool):
        mode, descriptor = dispatcher.dispatch(n, uniform_decode)
        seen.append((n, descriptor.num_tokens if descriptor else n))
        return mode, descriptor

    runner.dispatcher.dispatch = dispatch
    assert _generate(llm, PROMPTS) + _generate(llm, PROMPTS[:1]) == eager_tokens
    assert any(padded > n for n, padded in seen)  # steps really were padded
    padded_run = llm.generate([{"prompt_token_ids": PROMPTS[0]}], with_logprobs, use_tqdm=False)
    # Same tokens and ranks; values within fp32 rounding (a padded matmul blocks its rows
    # differently in the CPU's BLAS).
    got, want = padded_run[0].prompt_logprobs, reference[0].prompt_logprobs
    assert len(got) == len(want) > 1 and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        for token in g:
            assert g[token].rank == w[token].rank
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
