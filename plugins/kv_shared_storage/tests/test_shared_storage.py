"""kvloom-kv-shared-storage: the conformance kit, and two engines sharing one folder (the
seeds' example: an offline producer and an offline consumer) — the consumer gives exactly
one engine's greedy tokens and computes only what the folder did not hold (counted)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvloom import LLM, SamplingParams
from kvloom.testing.kv_connector import check_kv_connector
from kvloom.testing.models import random_prompts, tiny_model_dir

BLOCK = 16
PROMPTS = random_prompts(512, lengths=(37, 50, 64, 21), seed=7)


def _config(folder: Path, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder), **extra}}  # fmt: skip


@pytest.mark.parametrize("load_async", [False, True])
def test_conformance(tmp_path: Path, load_async: bool) -> None:
    assert check_kv_connector(_config(tmp_path, load_async=load_async), across_engines=True) == []


def test_the_old_name_and_a_missing_folder(tmp_path: Path) -> None:
    assert check_kv_connector({**_config(tmp_path), "kv_connector": "SharedStorageConnector"}, num_requests=2) == []
    with pytest.raises(ValueError, match="shared_storage_path: required"):
        check_kv_connector({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})


def _llm(**kwargs: Any) -> Any:
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        return LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                   **kwargs)  # fmt: skip


def _generate(llm: Any) -> tuple[list[list[int]], list[int], int]:
    """Greedy tokens, cached tokens per prompt, and the tokens the engine computed."""
    core = llm.llm_engine.engine_core.core
    computed = 0
    schedule = core.scheduler.schedule

    def counting() -> Any:
        nonlocal computed
        output = schedule()
        computed += output.total_num_scheduled_tokens
        return output

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with mock.patch.object(core.scheduler, "schedule", counting):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs], computed


@pytest.mark.parametrize("load_async", [False, True])
def test_two_engines_share_prefixes_through_the_folder(tmp_path: Path, load_async: bool) -> None:
    want, _, _ = _generate(_llm())
    produced, _, _ = _generate(_llm(kv_transfer_config=_config(tmp_path, "kv_producer")))
    assert produced == want
    got, cached, computed = _generate(_llm(kv_transfer_config=_config(tmp_path, "kv_consumer", load_async=load_async)))
    assert got == want
    assert cached == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    assert computed == sum(len(p) for p in PROMPTS) - sum(cached) + 5 * len(PROMPTS)  # the tails, then the decodes
