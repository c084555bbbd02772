"""kvloom's Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral against HF transformers on
the same weights.

The kvloom model runs over a paged KV cache through the test reference backend
(``PagedRunner``): batched prefill of prompts of different lengths, chunked prefill mixed
with decode, and greedy decoding; HF runs each sequence whole, in fp32.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.loader.model_loader import get_model
from tests.helpers.model_fixtures import (
    ARCHITECTURES,
    PagedRunner,
    assert_logits_close,
    hf_logits,
    load_hf_model,
    make_test_engine_config,
    make_tiny_model,
    tiny_model_dir,
)

#: The mixtures of experts among ARCHITECTURES.
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss")

PROMPTS = {
    "short": [3, 17, 250, 9, 41],
    "medium": [int(x) for x in torch.randint(3, 500, (23,), generator=torch.Generator().manual_seed(1))],
    "long": [int(x) for x in torch.randint(3, 500, (61,), generator=torch.Generator().manual_seed(2))],
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_setup(request):
    arch = request.param
    model_dir = tiny_model_dir(arch)
    config = make_test_engine_config(model_dir, block_size=8)
    model = get_model(config, "cpu")
    return arch, config, model, load_hf_model(model_dir)


def test_batched_prefill_matches_hf(arch_setup):
    _, config, model, hf = arch_setup
    runner = PagedRunner(model, config)
    out = runner.step(PROMPTS)
    for name, ids in PROMPTS.items():
        assert out[name].dtype == torch.float32
        assert out[name].shape == (len(ids), config.model.vocab_size)
        assert_logits_close(out[name], hf_logits(hf, ids))


def test_chunked_prefill_and_greedy_decode_match_hf(arch_setup):
    """Prompts arrive in chunks next to decoding requests; then 24 greedy tokens per
    request in batched decode steps. Tokens equal HF's greedy ``generate``; logits of the
    decoded steps are close to HF's over the whole sequence."""
    _, config, model, hf = arch_setup
    runner = PagedRunner(model, config)
    seqs = {name: list(ids) for name, ids in PROMPTS.items()}
    fed = dict.fromkeys(seqs, 0)
    chunk, new_tokens = 9, 24
    generated: dict[str, list[int]] = {name: [] for name in seqs}
    last_logits: dict[str, torch.Tensor] = {}
    while any(len(g) < new_tokens for g in generated.values()):
        # Up to `chunk` unfed tokens per request: prompt chunks, or the one token sampled
        # last step; requests whose prompt is done decode next to those still prefilling.
        scheduled = {
            name: seqs[name][fed[name] : fed[name] + chunk]
            for name in seqs
            if len(generated[name]) < new_tokens
        }
        out = runner.step(scheduled)
        for name, tokens in scheduled.items():
            fed[name] += len(tokens)
            if fed[name] == len(seqs[name]):  # prompt done: this step's last logits sample
                token = int(out[name][-1].argmax())
                generated[name].append(token)
                seqs[name].append(token)
                last_logits[name] = out[name][-1]
    for name, ids in PROMPTS.items():
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert generated[name] == expected, f"{name}: kvloom {generated[name]} != HF {expected}"
        assert_logits_close(last_logits[name][None], hf_logits(hf, seqs[name][:-1])[-1:])
    assert len({t for g in generated.values() for t in g}) > 8, "degenerate tiny model output"


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    ],
    ids=lambda p: p["rope_type"],
)
def test_llama_rope_scaling_matches_hf(tmp_path, rope_parameters):
    model_dir = make_tiny_model("llama", tmp_path, rope_parameters=rope_parameters)
    config = make_test_engine_config(model_dir)
    assert config.model.hf_config.rope_parameters["rope_type"] == rope_parameters["rope_type"]
    model = get_model(config, "cpu")
    hf = load_hf_model(model_dir)
    out = PagedRunner(model, config).step({"long": PROMPTS["long"]})
    assert_logits_close(out["long"], hf_logits(hf, PROMPTS["long"]))


def test_bfloat16_close_to_hf_bfloat16(arch_setup):
    arch, _, _, hf_fp32 = arch_setup
    model_dir = tiny_model_dir(arch)
    config = make_test_engine_config(model_dir, dtype=torch.bfloat16, block_size=8)
    model = get_model(config, "cpu")
    # gpt-oss's attention sinks stay float32 (as HF keeps them in the softmax's precision).
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if not n.endswith(".sinks"))
    hf = load_hf_model(model_dir, dtype=torch.bfloat16)
    out = PagedRunner(model, config).step({"long": PROMPTS["long"]})["long"]
    expected = hf_logits(hf, PROMPTS["long"])
    scale = expected.abs().max().item()
    per_position = (out - expected).abs().max(dim=-1).values
    if arch == "gemma3":
        # This tiny Gemma 3's bf16 is far from its own fp32 (q and k normalised per head
        # in bf16, then scores rounded to bf16 by HF's eager attention): HF's bf16 logits
        # are up to ~9% of the largest logit off HF's fp32 ones, ours ~8%, so the two bf16
        # runs differ by their rounding (~6%), not by a formula. The check: kvloom's bf16
        # is no further from the fp32 logits than HF's own bf16 (with 10% to spare).
        reference = hf_logits(hf_fp32, PROMPTS["long"]).double()
        ours = (out.double() - reference).abs().max(dim=-1).values
        theirs = (expected.double() - reference).abs().max(dim=-1).values
        assert ours.max() <= 1.1 * theirs.max() and ours.mean() <= 1.1 * theirs.mean(), (ours, theirs)
        top1 = reference.argmax(-1)
        # Greedy picks: as many of the fp32 model's as HF's bf16 keeps (0.89 vs 0.90 here), give or take 5%.
        assert (out.argmax(-1) == top1).float().mean() >= (expected.argmax(-1) == top1).float().mean() - 0.05
        return
    if arch in MOE_ARCHITECTURES:
        # A router near-tie rounds differently in bf16 and picks another expert at a few
        # positions (the tiny Mixtral: 2 of 61, where HF's own bf16 is ~1.0 off its fp32):
        # the other positions must be close.
        assert torch.quantile(per_position, 0.9).item() < 0.05 * scale
    else:
        assert per_position.max().item() < 0.05 * scale
    agreement = (out.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.9


def test_mistral_window_applies_at_every_length(tmp_path):
    """No cap to the window: every layer attends within it at the full context."""
    model_dir = make_tiny_model("mistral", tmp_path, with_tokenizer=False, sliding_window=32)
    config = make_test_engine_config(model_dir)
    model = get_model(config, "cpu")
    assert config.model.max_model_len > 32
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [32] * len(model.model.layers)


def test_qwen2_windows_only_the_layers_from_max_window_layers(tmp_path):
    model_dir = make_tiny_model(
        "qwen2", tmp_path, with_tokenizer=False, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    model = get_model(make_test_engine_config(model_dir), "cpu")
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows[0] is None and set(windows[1:]) == {16}


def test_llama_attention_and_mlp_biases_match_hf(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path, with_tokenizer=False, attention_bias=True, mlp_bias=True)
    config = make_test_engine_config(model_dir)
    model = get_model(config, "cpu")
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert model.model.layers[0].mlp.down_proj.bias is not None
    out = PagedRunner(model, config).step(PROMPTS)
    hf = load_hf_model(model_dir)
    for name, ids in PROMPTS.items():
        assert_logits_close(out[name], hf_logits(hf, ids))
