"""MLA backends end to end on a CUDA GPU (issue 17): a tiny random DeepSeek-V2 model.

- TRITON_MLA (both phases) in fp32 gives HF's greedy tokens (CPU_MLA's reference path gives
  the same tokens on the CPU: tests of the MLA contract), eagerly and with CUDA graphs, and
  with prefix caching, forced chunked prefill and forced preemption.
- FLASHINFER_MLA (decode; TRITON_MLA prefill) in bf16 on a tiny model with DeepSeek's latent
  widths (kv_lora_rank 512, rope 64, which FlashInfer's MLA kernels require): its greedy
  tokens are as good as bf16 allows, eagerly and with CUDA graphs: the share of them that HF
  fp32, teacher-forced on the same sequence, ranks first is at least HF bf16's own share
  (HF's bf16 greedy run judged the same way) less 5 points, i.e. 6 of the 120 tokens judged
  (measured on the H100 on 2026-11-25: FLASHINFER_MLA 0.942, TRITON_MLA 0.958-0.967, HF bf16
  0.983; FLASHINFER_MLA's kernel is slightly noisier in bf16, relative error 2.3e-3 against
  TRITON_MLA's 1.9e-3 in bench_mla_decode, both inside the conformance kit's 1e-2; a wrong
  decode kernel scores far lower). Greedy sequences are not compared
  token by token: on a random tiny model one bf16 near-tie makes two correct runs diverge for
  the rest of the sequence (measured on the H100: 85% positional agreement between FLASHINFER_MLA
  and TRITON_MLA, both bf16).

Run on the device with ``bash tests/gpu/run.sh mla``.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers.hf_agreement import hf_greedy, top1_agreement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N_TOKENS = 24


def _installed(name: str) -> bool:
    from kvloom import plugins

    plugins.load_plugins()
    return name in plugins.attention_backends()


def _tokens(model: Path, prompts: list[list[int]], dtype: str, decode: str, prefill: str, **kwargs) -> list[list[int]]:
    from kvloom import LLM, SamplingParams

    kwargs.setdefault("cudagraph_capture_sizes", [1, 2, 4, 8])
    llm = LLM(str(model), dtype=dtype, attention_backend=decode, mla_prefill_backend=prefill,
              kv_cache_memory="1GiB", **kwargs)
    sp = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]


def _top1_agreement(model: Path, prompts: list[list[int]], generated: list[list[int]]) -> float:
    """Share of ``generated`` tokens that HF fp32, teacher-forced on prompt + generated, ranks first."""
    from kvloom.testing.models import load_hf_model

    hf = load_hf_model(model).to("cuda")
    agreement = top1_agreement(hf, prompts, generated)
    del hf
    torch.cuda.empty_cache()
    return agreement


def _hf_bf16_greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from kvloom.testing.models import load_hf_model

    hf = load_hf_model(model, torch.bfloat16).to("cuda")
    outs = hf_greedy(hf, prompts, N_TOKENS)
    del hf
    torch.cuda.empty_cache()
    return outs


@pytest.fixture(scope="module")
def tiny_v2(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from kvloom.testing.models import make_tiny_model

    return make_tiny_model("deepseek_v2", tmp_path_factory.mktemp("v2") / "deepseek_v2")


@pytest.fixture(scope="module")
def tiny_v2_wide(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from kvloom.testing.models import make_tiny_model

    return make_tiny_model("deepseek_v2", tmp_path_factory.mktemp("v2w") / "deepseek_v2_wide",
                           kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, num_key_value_heads=16)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from kvloom.testing.models import random_prompts

    return random_prompts(512)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"enforce_eager": True}, id="eager"),
        pytest.param({}, id="cudagraphs"),
        pytest.param({"enforce_eager": True, "enable_prefix_caching": True, "max_num_batched_tokens": 32,
                      "max_num_seqs": 8}, id="chunked"),
        pytest.param({"enforce_eager": True, "enable_prefix_caching": True, "num_gpu_blocks_override": 12,
                      "max_model_len": 128}, id="preemption"),
    ],
)
def test_triton_mla_fp32_gives_hf_tokens(tiny_v2: Path, prompts: list[list[int]], kwargs: dict) -> None:
    if not _installed("TRITON_MLA"):
        pytest.skip("kvloom-backend-triton-mla is not installed")
    from kvloom.testing.models import hf_greedy_tokens

    expected = hf_greedy_tokens(tiny_v2, prompts, N_TOKENS)
    assert _tokens(tiny_v2, prompts, "float32", "TRITON_MLA", "TRITON_MLA", **kwargs) == expected


@pytest.fixture(scope="module")
def hf_bf16_yardstick(tiny_v2_wide: Path, prompts: list[list[int]]) -> float:
    """What bf16 allows on this model: HF bf16's greedy tokens judged by HF fp32."""
    return _top1_agreement(tiny_v2_wide, prompts, _hf_bf16_greedy(tiny_v2_wide, prompts))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraphs"])
def test_flashinfer_mla_bf16_top1_agreement(tiny_v2_wide: Path, prompts: list[list[int]], hf_bf16_yardstick: float,
                                            eager: bool) -> None:  # fmt: skip
    if not (_installed("FLASHINFER_MLA") and _installed("TRITON_MLA")):
        pytest.skip("FLASHINFER_MLA or TRITON_MLA is not installed")
    pytest.importorskip("flashinfer")
    fi = _tokens(tiny_v2_wide, prompts, "bfloat16", "FLASHINFER_MLA", "TRITON_MLA", enforce_eager=eager,
                 block_size=16)
    tr = _tokens(tiny_v2_wide, prompts, "bfloat16", "TRITON_MLA", "TRITON_MLA", enforce_eager=eager, block_size=16)
    fi_top1, tr_top1 = _top1_agreement(tiny_v2_wide, prompts, fi), _top1_agreement(tiny_v2_wide, prompts, tr)
    print(f"bf16 top-1 agreement with HF fp32: FLASHINFER_MLA {fi_top1:.3f}, TRITON_MLA {tr_top1:.3f}, "
          f"HF bf16 {hf_bf16_yardstick:.3f}")
    assert fi_top1 >= min(0.99, hf_bf16_yardstick - 0.05), (fi_top1, hf_bf16_yardstick)
    assert tr_top1 >= min(0.99, hf_bf16_yardstick - 0.05), (tr_top1, hf_bf16_yardstick)
