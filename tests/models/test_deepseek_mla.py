"""DeepSeek-V2/V3 (multi-head latent attention, MoE) against HF transformers.

Tiny random models (``kvloom.testing.models``: 3 layers, the first dense, the others
MoE with a shared expert; kv_lora_rank 32, rope dim 16; V2 without q_lora_rank, V3 with
it and with DeepSeek's YaRN) give exactly HF's greedy tokens in fp32 through the whole
engine on CPU_MLA, also with prefix-cache hits (the decode and prefill paths read the
latent cache), chunked prefill (prefill over a cached prefix), forced preemption and an
odd block size. The latent cache and its sizing are checked directly.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model_fixtures import greedy_counting_preemptions, hf_greedy_tokens, random_prompts, tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.attention.mla_layer import MLAAttention
from kvloom.testing.models import TINY_MLA_ARCHITECTURES

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 16, 23, 41)


@pytest.fixture(scope="module", autouse=True)
def _in_process(request):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the tests look at the engine core's runner
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hf_reference() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    ref = {}
    for arch in TINY_MLA_ARCHITECTURES:
        prompts = random_prompts(512, PROMPT_LENGTHS)
        # A shared 16-token prefix: the later requests hit the prefix cache.
        prompts.append(prompts[2][:16] + prompts[0])
        ref[arch] = (prompts, hf_greedy_tokens(tiny_model_dir(arch), prompts, NEW_TOKENS))
    return ref


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.core.worker.model_runner


@pytest.mark.parametrize("arch", TINY_MLA_ARCHITECTURES)
def test_greedy_matches_hf(arch, hf_reference):
    prompts, expected = hf_reference[arch]
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True)
    assert _generate(llm, prompts) == expected
    # Again: every prompt now hits the prefix cache (prefill over a cached latent prefix,
    # and one-token "prefills" that run as decodes over the latent cache).
    assert _generate(llm, prompts) == expected


@pytest.mark.parametrize("arch", TINY_MLA_ARCHITECTURES)
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-caching"),
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 8}, id="chunked-prefill"),
        # 16 blocks of 8 tokens cannot hold 5 requests of up to 65 tokens: preemption.
        pytest.param({"num_gpu_blocks_override": 16, "max_model_len": 72, "block_size": 8}, id="preemption"),
        pytest.param({"block_size": 5}, id="odd-block-size"),
    ],
)
def test_greedy_matches_hf_under_scheduling_pressure(arch, engine_kwargs, hf_reference):
    prompts, expected = hf_reference[arch]
    kwargs = {"kv_cache_memory": "16MiB", **engine_kwargs}
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", disable_log_stats=True, **kwargs)
    assert _generate(llm, prompts) == expected


def test_preemption_really_happens(hf_reference):
    prompts, expected = hf_reference["deepseek_v2"]
    llm = LLM(
        str(tiny_model_dir("deepseek_v2")), dtype="float32", num_gpu_blocks_override=16, max_model_len=72,
        block_size=8, disable_log_stats=True,
    )  # fmt: skip
    tokens, preemptions = greedy_counting_preemptions(llm, prompts, NEW_TOKENS)
    assert preemptions > 0
    assert tokens == expected


def test_latent_cache_layout_and_sizing():
    llm = LLM(str(tiny_model_dir("deepseek_v3")), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    runner = _runner(llm)
    layers = runner.attn_layers
    assert len(layers) == 3 and all(isinstance(layer, MLAAttention) for layer in layers)
    latent = 32 + 16  # kv_lora_rank + qk_rope_head_dim, no head dimension
    for layer in layers:
        assert layer.kv_cache.shape[1:] == (16, latent)
    # The sizing counts one latent row per token per layer (fp32): 3 * 16 * 48 * 4 bytes.
    assert runner.kv_cache_bytes_per_block() == 3 * 16 * latent * 4
    num_blocks = layers[0].kv_cache.shape[0]
    assert num_blocks == (16 * 2**20) // runner.kv_cache_bytes_per_block()
    config = llm.llm_engine.engine_core.core.config
    assert config.attention.backend.NAME == "CPU_MLA" and config.attention.prefill_backend.NAME == "CPU_MLA"


def test_dummy_load_format_runs():
    llm = LLM(str(tiny_model_dir("deepseek_v2")), dtype="float32", kv_cache_memory="8MiB", load_format="dummy")
    out = _generate(llm, [[5, 6, 7, 8]])
    assert len(out[0]) == NEW_TOKENS
    assert all(0 <= t < 512 for t in out[0])


def test_absorbed_weights_are_views_of_kv_b_proj():
    llm = LLM(str(tiny_model_dir("deepseek_v2")), dtype="float32", kv_cache_memory="8MiB")
    layer = _runner(llm).attn_layers[0]
    w_uk, w_uv = layer.absorbed_weights()
    assert w_uk.shape == (4, 16, 32) and w_uv.shape == (4, 24, 32)
    w = layer.kv_b_proj.weight.view(4, 16 + 24, 32)
    assert torch.equal(w_uk, w[:, :16]) and torch.equal(w_uv, w[:, 16:])
    assert w_uk.data_ptr() == layer.kv_b_proj.weight.data_ptr()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        # V3: sigmoid scores steered by a (non-zero) correction bias, 4 groups keep 2, renormalised.
        ("deepseek_v3", dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                             routed_scaling_factor=2.5, norm_topk_prob=True)),
        # V2: softmax scores, group-limited greedy top-k.
        ("deepseek_v2", dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                             topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    ],
)  # fmt: skip
def test_routing_variants_match_hf(arch, overrides, tmp_path):
    from safetensors.torch import load_file, save_file

    from kvloom.testing.models import save_tiny_checkpoint, tiny_hf_config

    model_dir = save_tiny_checkpoint(tiny_hf_config(arch, **overrides), tmp_path / arch)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):  # HF initialises it to zeros, which hides its role
            tensors[name] = torch.rand(tensors[name].shape, generator=g) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 30))
    expected = hf_greedy_tokens(model_dir, prompts, NEW_TOKENS)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", disable_log_stats=True)
    assert _generate(llm, prompts) == expected
