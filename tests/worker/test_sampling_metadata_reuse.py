"""The model runner reuses a step's sampling tensors for the next steps of the same rows
(``SamplingMetadata.reusable``, keyed by the input batch's version and the rows' ids) and
rebuilds them when the rows change or the tensors depend on the tokens so far."""

from __future__ import annotations

import pytest
from tests.helpers.model_fixtures import random_prompts, tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.sample.metadata import SamplingMetadata
from kvloom.worker import step_sampler

PROMPTS = random_prompts(4)


class CountingMetadata(SamplingMetadata):
    builds = 0

    @classmethod
    def build(cls, **kwargs):  # type: ignore[override]
        CountingMetadata.builds += 1
        return SamplingMetadata.build(**kwargs)


@pytest.fixture
def llm(monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    monkeypatch.setattr(step_sampler, "SamplingMetadata", CountingMetadata)
    CountingMetadata.builds = 0
    return LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)


def _generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts=PROMPTS):
    CountingMetadata.builds = 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_an_unchanged_greedy_batch_builds_its_sampling_tensors_once(llm):
    _generate(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert CountingMetadata.builds == 1  # the prefill step; 11 decode steps reuse it


def test_penalties_rebuild_every_step(llm):
    _generate(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5))
    assert CountingMetadata.builds == 12


def test_min_tokens_rebuild_until_every_row_has_them_and_then_lifts_the_ban(llm):
    base = _generate(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tokens = base[0][0]
    # A stop token the greedy sequence first produces at index k >= 4: banning it for the
    # first 2 outputs changes nothing, and a ban kept past them would skip the stop.
    k = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    held = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=2, stop_token_ids=[tokens[k]])
    assert _generate(llm, held, PROMPTS[:1]) == [(tokens[: k + 1], "stop")]
    # Prefill (0 outputs) and the step with 1 output rebuild; from 2 outputs on it is reused.
    assert CountingMetadata.builds == 3


def test_a_batch_change_rebuilds(llm):
    # Different lengths: each departure changes the batch once.
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    _generate(llm, params)
    assert CountingMetadata.builds == len(PROMPTS)
