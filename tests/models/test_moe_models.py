"""The mixture-of-experts models (Qwen3-MoE, Mixtral) beyond the shared parity tests
(test_parity.py, tests/e2e/test_generate.py run them with every dense architecture):
which layers get experts (``decoder_sparse_step``, ``mlp_only_layers``), dummy weights,
and the per-expert checkpoint names the loader expects."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.layers.fused_moe import FusedMoE
from kvloom.loader.model_loader import checkpoint_weight_names, get_model
from kvloom.models.llama import LlamaMLP
from tests.helpers.model_fixtures import (
    PagedRunner,
    assert_logits_close,
    hf_logits,
    load_hf_model,
    make_test_engine_config,
    make_tiny_model,
    tiny_model_dir,
)

PROMPT = [int(x) for x in torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(3))]


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    model_dir = make_tiny_model("qwen3_moe", tmp_path, num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3])
    config = make_test_engine_config(model_dir)
    model = get_model(config, "cpu")
    hf = load_hf_model(model_dir)
    kinds = [type(layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.mlp) for layer in model.model.layers]
    hf_kinds = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert hf_kinds == [False, True, False, False, False]  # (i + 1) % 2 == 0, minus layer 3
    assert kinds == [FusedMoE if sparse else LlamaMLP for sparse in hf_kinds]
    out = PagedRunner(model, config).step({"p": PROMPT})["p"]
    assert_logits_close(out, hf_logits(hf, PROMPT))


@pytest.mark.parametrize(("arch", "expert_names"), [("qwen3_moe", "gate_proj"), ("mixtral", "w1")])
def test_checkpoint_names_are_the_per_expert_tensors(arch, expert_names):
    config = make_test_engine_config(tiny_model_dir(arch))
    model = get_model(config, "cpu")
    names = set(checkpoint_weight_names(model))
    block = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    assert f"model.layers.0.{block}.gate.weight" in names
    assert f"model.layers.0.{block}.experts.7.{expert_names}.weight" in names
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir(arch) / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_dummy_weights(arch):
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", kv_cache_memory="32MiB", load_format="dummy")
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 6
