"""End to end on the CPU for models with sliding-window layers (issue 38): kvloom's greedy
tokens equal HF transformers' in float32 for prompts several windows long, with prefix
caching on (hits measured, on prompts that extend earlier ones), with chunked prefill and
forced preemption; and a long request on a window model keeps only a window's blocks in
its window layers.

Models (tiny, random, ``initializer_range`` 0.1): Mistral with a window of 16 on every
layer (one sliding-window group), Qwen2 with ``use_sliding_window`` (layer 0 full, layer 1
windowed: two groups), Gemma 2 (alternating, logit soft-caps), Gemma 3 (three windowed
layers and one full: four groups), gpt-oss (alternating, sinks, experts), and Gemma 2 with
an untied LM head.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvloom import LLM, SamplingParams
from kvloom.kv_cache.spec import SlidingWindowSpec, kv_cache_config_of
from kvloom.utils import cdiv
from tests.helpers.model_fixtures import greedy_counting_preemptions, hf_greedy_tokens, make_tiny_model, random_prompts

WINDOW = 16
NEW_TOKENS = 24
#: Several windows long, crossing 16-token blocks in different ways.
PROMPT_LENGTHS = (43, 75)
MAX_MODEL_LEN = 128

MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "gpt_oss": ("gpt_oss", {}),
    "gemma2_untied": ("gemma2", {"tie_word_embeddings": False}),
}


@pytest.fixture(scope="module", autouse=True)
def _in_process(monkeypatch_module: pytest.MonkeyPatch) -> None:
    # The engine core in this process: the tests read its scheduler and block pool.
    monkeypatch_module.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid_model(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]], list[list[int]]]:
    """The model directory, its prompts, the same prompts extended (a prefix-cache hit that
    ends inside the cached part), and HF's greedy tokens for both."""
    arch, overrides = MODELS[request.param]
    model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(request.param) / arch, **overrides)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = random_prompts(vocab, PROMPT_LENGTHS)
    extended = [p + q for p, q in zip(prompts, random_prompts(vocab, (21, 9), seed=7))]
    expected = hf_greedy_tokens(model_dir, prompts + extended, NEW_TOKENS)
    return model_dir, prompts, extended, expected


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_greedy_matches_hf_with_prefix_caching(hybrid_model):
    model_dir, prompts, extended, expected = hybrid_model
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN,
              disable_log_stats=True)  # fmt: skip
    assert llm.llm_engine.engine_core.core.scheduler.kv_cache_manager.enable_caching
    tokens, _ = _generate(llm, prompts)
    assert tokens == expected[: len(prompts)]
    # The extended prompts hit what the first ones left in the prefix cache; the hit of a
    # window group needs the blocks at the end of the hit, given back but still cached.
    tokens, cached = _generate(llm, extended)
    assert tokens == expected[len(prompts) :]
    assert all(c >= (len(p) // 16) * 16 - 16 for c, p in zip(cached, prompts)), cached
    assert sum(cached) > 0
    assert len({t for seq in expected for t in seq}) >= 10, "degenerate tiny model output"


def test_greedy_matches_hf_with_chunked_prefill_and_preemption(hybrid_model):
    model_dir, prompts, extended, expected = hybrid_model
    prompts, expected = prompts + extended[:1], expected[: len(prompts)] + expected[len(prompts) : len(prompts) + 1]
    from transformers import AutoConfig

    batched = 16
    kv = kv_cache_config_of(AutoConfig.from_pretrained(model_dir), 16, MAX_MODEL_LEN)
    # One request of max_model_len fits, with a little room: three at once do not.
    num_blocks = kv.blocks_per_request(MAX_MODEL_LEN, batched) + kv.needs_null_block + 2
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=batched,
              max_num_seqs=4, num_gpu_blocks_override=num_blocks, disable_log_stats=True)  # fmt: skip
    tokens, preemptions = greedy_counting_preemptions(llm, prompts, NEW_TOKENS)
    assert tokens == expected
    assert preemptions > 0


def test_window_layers_hold_a_window_of_blocks_for_a_long_request(tmp_path):
    """One 8k-token request on a model with a window of 16 (layer 0 full, layer 1 windowed):
    the window group's blocks stay bounded by the window (plus the step's chunk) at every
    step, while the full-attention group holds the whole sequence."""
    length, chunk, block_size = 8192, 512, 16
    model_dir = make_tiny_model("qwen2", tmp_path / "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                max_window_layers=1, max_position_embeddings=length + 64)  # fmt: skip
    llm = LLM(str(model_dir), dtype="float32", max_model_len=length + 64, max_num_batched_tokens=chunk,
              block_size=block_size, disable_log_stats=True)  # fmt: skip
    engine = llm.llm_engine
    kv = engine.engine_core.core.scheduler.kv_cache_manager
    (full,) = [m for m in kv.managers if not isinstance(m.kv_cache_spec, SlidingWindowSpec)]
    (window,) = [m for m in kv.managers if isinstance(m.kv_cache_spec, SlidingWindowSpec)]
    prompt = random_prompts(500, (length,))[0]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))  # fmt: skip
    bound_prefill = cdiv(WINDOW - 1 + chunk, block_size) + 1
    bound_decode = cdiv(WINDOW - 1 + 1, block_size) + 1
    held_window, held_full, steps = [], [], 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        blocks = window.req_to_blocks.get("long", [])
        held_window.append(sum(1 for b in blocks if b is not kv.block_pool.null_block))
        held_full.append(len(full.req_to_blocks.get("long", [])))
    assert steps >= length // chunk
    assert max(held_window) <= bound_prefill, held_window
    assert held_window[-2] <= bound_decode, held_window  # decoding (the last step frees it)
    assert max(held_full) >= length // block_size
    # The pool holds both: window blocks given back went to the free queue.
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
