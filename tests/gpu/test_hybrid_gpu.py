"""Models with sliding-window layers on a CUDA GPU (issue 38), for each fp32 GPU backend
that declares the features they need: tiny random Gemma 2 (alternating windowed/full
layers, logit soft-caps), Gemma 3 (three windowed layers to one full, q/k norms) and
gpt-oss (alternating, attention sinks, experts), built with transformers from a config
(no model hub), give HF's fp32 greedy tokens on the GPU for prompts several windows (16)
long: in CUDA graphs, eager, and with chunked prefill (32-token steps).

Run on the device with ``bash tests/gpu/run.sh hybrid``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.gpu.test_e2e_gpu import FP32_BACKENDS, _hf_greedy, _kvloom_tokens, _need, _random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HYBRID_ARCHS = ["gemma2", "gemma3", "gpt_oss"]
#: Several windows of 16 long, off block borders.
PROMPT_LENGTHS = (5, 43, 75, 120)
NEW_TOKENS = 40


def _declares_features(backend: str, arch: str) -> bool:
    from kvloom import plugins
    from kvloom.attention import selector

    plugins.load_plugins()
    cls = selector.get_attention_backend(backend)
    needs = {"gemma2": ("supports_sliding_window", "supports_logits_soft_cap"),
             "gemma3": ("supports_sliding_window",),
             "gpt_oss": ("supports_sliding_window", "supports_sinks")}[arch]  # fmt: skip
    return all(getattr(cls, need, False) for need in needs)


@pytest.fixture(scope="module")
def hybrid_refs(tmp_path_factory):
    from transformers import AutoConfig

    from tests.helpers.model_fixtures import make_tiny_model

    refs = {}
    for arch in HYBRID_ARCHS:
        d = str(make_tiny_model(arch, tmp_path_factory.mktemp(arch) / arch))
        prompts = _random_prompts(AutoConfig.from_pretrained(d).vocab_size, PROMPT_LENGTHS)
        refs[arch] = (d, prompts, _hf_greedy(d, prompts, NEW_TOKENS))
    return refs


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("mode", ["graphs", "eager", "chunked"])
def test_hybrid_fp32_greedy_matches_hf(hybrid_refs, arch, backend, mode):
    _need(backend, torch.float32)
    if not _declares_features(backend, arch):
        pytest.skip(f"{backend} does not declare the attention features {arch} needs")
    d, prompts, expected = hybrid_refs[arch]
    kwargs = {"eager": {"enforce_eager": True}, "chunked": {"max_num_batched_tokens": 32, "max_num_seqs": 8}, "graphs": {}}[mode]
    assert _kvloom_tokens(d, prompts, NEW_TOKENS, "float32", backend, **kwargs) == expected
