"""Structured outputs on CUDA: xgrammar's kernel masks the same logits as the torch path
(bf16 and fp32, a padded vocabulary, structured rows among unstructured ones), and a batch
of sampled JSON-schema requests all validate.

The overhead benchmark is ``benchmarks/bench_structured_output.py`` (``tests/gpu/run.sh so``)."""

from __future__ import annotations

import json

import pytest
import torch

from kvloom.structured_output.bitmask import allowed_mask, apply_grammar_bitmask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151936, 49152, 1000])
def test_cuda_kernel_matches_the_torch_reference(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g).to("cuda", dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, words), generator=g, dtype=torch.int64).to(torch.int32)
    req_ids = [f"r{i}" for i in range(64)]
    rows = {f"r{i}": j for j, i in enumerate(range(0, 64, 4))}  # every fourth request is structured
    expected = logits.clone()
    allowed = allowed_mask(bitmask, vocab).to("cuda")
    for req_id, j in rows.items():
        i = int(req_id[1:])
        expected[i] = expected[i].masked_fill(~allowed[j], float("-inf"))
    apply_grammar_bitmask(logits, req_ids, rows, bitmask)
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)


def test_json_schema_requests_on_cuda_all_validate() -> None:
    """32 sampled (temperature 1) JSON-schema requests at once on a tiny random Llama
    with a real byte-level tokenizer, on CUDA with CUDA graphs: every output ends with
    its grammar and validates against the CPU acceptance schema."""
    from kvloom import LLM, SamplingParams, StructuredOutputsParams
    from kvloom.testing.json_schema import schema_errors
    from kvloom.testing.models import tiny_model_dir
    from tests.structured_output.test_generate import SCHEMA

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="1GiB", max_num_seqs=32,
              disable_log_stats=True)  # fmt: skip
    assert llm.config.device.device_type == "cuda"
    # The tokenizer is byte-level with few merges (about a character a token): the
    # schema's longest object (about 140 characters with ", " and ": ") fits 200 tokens.
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))  # fmt: skip
    prompts = [f"Pet number {i} as JSON:" for i in range(16)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 32
    for c in completions:
        assert c.finish_reason == "stop", c.text
        assert schema_errors(json.loads(c.text), SCHEMA) == [], c.text
    assert len({c.text for c in completions}) > 1  # sampled, not one forced answer
    llm.llm_engine.shutdown()


def test_async_scheduling_keeps_greedy_constrained_tokens_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (CUDA graphs, pinned copies): structured steps sampled after their forward
    (async scheduling) give the synchronous engine's greedy tokens for a JSON schema, a
    regex and a choice mixed with unconstrained requests, and bitmasks were filled late."""
    from kvloom import LLM
    from kvloom.scheduler.scheduler import Scheduler
    from kvloom.testing.models import tiny_model_dir
    from tests.structured_output.test_async_structured import PROMPTS, _check_constrained, _params

    def run(**kwargs: object) -> list:
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="1GiB", disable_log_stats=True,
                  **kwargs)  # fmt: skip
        assert llm.config.device.device_type == "cuda"
        try:
            outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]

    expected = run(async_scheduling=False)
    _check_constrained(expected)
    fills: list[int] = []
    fill = Scheduler.get_grammar_bitmask

    def spy(self: Scheduler, so: object) -> object:
        fills.append(1)
        return fill(self, so)

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy lives in this process
    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", spy)
    assert run(async_scheduling=True) == expected
    assert fills
