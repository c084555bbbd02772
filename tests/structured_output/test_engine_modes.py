"""Structured outputs under the engine's modes, on a tiny random Llama: async scheduling
(greedy tokens identical to the synchronous engine; more in ``test_async_structured``),
chunked prefill, prefix caching and preemption, and n > 1."""

from __future__ import annotations

import re

import pytest
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom import LLM, SamplingParams, StructuredOutputsParams

PATTERN = r"[a-z]{3,8}( [a-z]{2,6}){2}\."
PROMPTS = ["Tell me three words.", "Tell me three words, again.", "Something else entirely"]


def _llm(**kwargs) -> LLM:
    return LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True,
               **kwargs)  # fmt: skip


def _run(llm: LLM, n: int = 1, temperature: float = 0.0) -> list[list[tuple[list[int], str]]]:
    params = SamplingParams(n=n, temperature=temperature, seed=5, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(regex=PATTERN))  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate(PROMPTS + ["plain request"], [params] * len(PROMPTS) + [plain], use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def sync_result() -> list:
    return _run(_llm())


@pytest.mark.parametrize("engine_kwargs", [
    pytest.param({"async_scheduling": True}, id="async"),
    pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 8}, id="chunked-prefill"),
    pytest.param({"num_gpu_blocks_override": 10, "max_model_len": 96}, id="preemption"),
    pytest.param({"enable_prefix_caching": False, "block_size": 5}, id="no-prefix-caching"),
])  # fmt: skip
def test_greedy_constrained_tokens_are_the_same_in_every_mode(sync_result: list, engine_kwargs: dict) -> None:
    for outputs in sync_result[:-1]:
        for _, text, reason in outputs:
            assert re.fullmatch(PATTERN, text) and reason == "stop", text
    assert _run(_llm(**engine_kwargs)) == sync_result


def test_n_siblings_each_follow_the_grammar() -> None:
    result = _run(_llm(async_scheduling=True), n=4, temperature=1.0)
    for outputs in result[:-1]:
        assert len(outputs) == 4
        for _, text, reason in outputs:
            assert re.fullmatch(PATTERN, text) and reason == "stop", text
