"""End to end on the CPU at the block sizes FLASH_ATTN forces (256, 512): greedy tokens
equal HF transformers' with prefix caching on, chunked prefill forced and preemption
forced (docs/attention_backends.md, "Block-size negotiation").

CPU_ATTN accepts any block size, so the engine runs the whole scheduler / KV-cache /
runner path with the block sizes a FLASH_ATTN deployment uses; what changes with big
blocks is the prefix-cache granularity (only full 256/512-token blocks are shared), the
slot arithmetic and the number of blocks preemption frees. The prompts share a 600-token
prefix (two full blocks of 256, one of 512) and are long enough to span several blocks.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model_fixtures import load_hf_model, make_tiny_model

from kvloom import LLM, SamplingParams

NEW_TOKENS = 24
SHARED_PREFIX = 600
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory):
    # The shared tiny models allow 256 positions; these prompts need ~900.
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-long"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def prompts_and_reference(long_model) -> tuple[list[list[int]], list[list[int]]]:
    model = load_hf_model(long_model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(4321)
    prefix = torch.randint(3, vocab, (SHARED_PREFIX,), generator=g).tolist()
    # First a prompt sharing nothing, whose decode crosses token 512 (a block boundary at
    # both sizes) while the others hold the cache: it needs a block that is not free.
    prompts = [torch.randint(3, vocab, (500,), generator=g).tolist()]
    prompts += [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (10, 150, 300)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            expected.append(out[0, len(p):].tolist())
    assert len({t for seq in expected for t in seq}) >= 10  # distinct, context-dependent tokens
    return prompts, expected


# Blocks per request at 256: 3, 3, 4, 4 (2 of them shared by the last three); at 512:
# 2, 2, 2, 2 (1 shared). The overrides hold the largest request but not all of them at
# once: the scheduler must preempt.
@pytest.mark.parametrize(("block_size", "num_blocks"), [(256, 6), (512, 3)])
def test_large_blocks_match_hf_with_prefix_caching_chunking_and_preemption(
    long_model, prompts_and_reference, block_size: int, num_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # counts the core's preemptions step by step
    prompts, expected = prompts_and_reference
    llm = LLM(
        str(long_model), dtype="float32", attention_backend="CPU_ATTN", block_size=block_size,
        enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=num_blocks, disable_log_stats=True,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run_all() -> tuple[list[list[int]], list[int], int]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        tokens: dict[str, list[int]] = {}
        cached: dict[str, int] = {}
        preemptions = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    cached[out.request_id] = out.num_cached_tokens
            preemptions += engine.engine_core.core.scheduler.make_stats().num_preemptions
        ids = [str(i) for i in range(len(prompts))]
        return [tokens[i] for i in ids], [cached[i] for i in ids], preemptions

    first_tokens, first_cached, first_preemptions = run_all()
    assert first_tokens == expected
    assert first_preemptions > 0  # the small cache really forced preemption
    # Again, now that the shared prefix's full blocks may be cached: same tokens.
    second_tokens, second_cached, _ = run_all()
    assert second_tokens == expected
    hits = first_cached + second_cached
    assert all(h % block_size == 0 for h in hits), hits  # only whole blocks are shared
    # Every prompt with the shared prefix found its full blocks (512 tokens at both sizes)
    # in the cache the second time.
    shared_full_blocks = SHARED_PREFIX // block_size * block_size
    assert min(second_cached[1:]) >= shared_full_blocks, (block_size, first_cached, second_cached)
