"""End to end on a CUDA GPU, for every installed GPU attention backend.

- fp32 backends: tiny random Llama/Qwen3/Qwen3-MoE/Mixtral models and SmolLM2 give HF's
  greedy tokens (the MoE models through the Triton fused_moe kernels, in CUDA graphs).
- every backend in bf16, over >= 1,000 greedy tokens of SmolLM2 (8 chat prompts x 128):
  top-1 agreement = the share of kvloom's generated tokens that HF, run on the same GGUF
  weights and teacher-forced on the prompt plus kvloom's tokens, ranks first at each
  position. Measured against HF in fp32 (asserted: 99%, or within half a point of HF's own
  bf16 greedy run measured the same way, which reaches ~98.4%) and against HF in bf16
  (recorded only). Both, with HF bf16's own fp32 agreement, are appended as one JSON line
  per backend to $OUT/bf16_agreement.jsonl ($OUT defaults to /tmp).
- CUDA-graph and eager runs give identical tokens; so do async and synchronous scheduling.
- prefix caching, forced chunked prefill and forced preemption keep the tokens (fp32
  backends) or meet the same bf16 agreement criterion over 1,024 tokens (bf16-only backends).

Run on the device with ``bash tests/gpu/run.sh e2e``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers.hf_agreement import hf_greedy, top1_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP32_BACKENDS = ["TRITON_ATTN", "FLEX_ATTENTION"]
ALL_BACKENDS = ["TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "FLASH_ATTN"]
KV_MEMORY = "2GiB"
#: Tiny random models run in fp32; the mixtures of experts run the CUDA platform's Triton
#: fused_moe kernels (IEEE-precision fp32 dots), in CUDA graphs.
TINY_ARCHS = ["llama", "qwen3", "qwen3_moe", "mixtral"]


def _usable(name: str, dtype: torch.dtype) -> bool:
    from kvloom.attention import selector
    from kvloom import plugins
    from kvloom.attention.backend import AttentionSelectorConfig
    from kvloom.platforms.interface import DeviceCapability

    plugins.load_plugins()
    if name not in plugins.attention_backends():
        return False
    backend = selector.get_attention_backend(name)
    cfg = AttentionSelectorConfig(
        head_size=64, dtype=dtype, device_type="cuda",
        device_capability=DeviceCapability(*torch.cuda.get_device_capability()),
    )
    return not backend.validate_configuration(cfg)


def _need(name: str, dtype: torch.dtype = torch.bfloat16) -> None:
    if not _usable(name, dtype):
        pytest.skip(f"{name} is not installed or not valid here for {dtype}")


def _free(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _kvloom_tokens(model, prompts, n, dtype, backend, **kwargs) -> list[list[int]]:
    from kvloom import LLM, SamplingParams

    kwargs.setdefault("cudagraph_capture_sizes", [1, 2, 4, 8])  # the test batches need no more
    llm = LLM(model, dtype=dtype, attention_backend=backend, kv_cache_memory=KV_MEMORY, **kwargs)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    _free(llm)
    return tokens


def _hf_model(model: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return m.eval().cuda()


def _hf_greedy(model: str, prompts, n: int) -> list[list[int]]:
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = _hf_model(model, torch.float32)
    outs = hf_greedy(hf, prompts, n)
    del hf
    torch.cuda.empty_cache()
    return outs


def _top1_agreement(model: str, prompts, generated, dtype: torch.dtype) -> float:
    """Fraction of kvloom's generated tokens that HF (same dtype, teacher-forced) ranks first."""
    hf = _hf_model(model, dtype)
    agreement = top1_agreement(hf, prompts, generated)
    del hf
    torch.cuda.empty_cache()
    return agreement


def _random_prompts(vocab: int, lengths=(5, 16, 23, 41, 64), seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_refs():
    from tests.helpers.model_fixtures import tiny_model_dir
    from transformers import AutoConfig

    refs = {}
    for arch in TINY_ARCHS:
        d = str(tiny_model_dir(arch))
        prompts = _random_prompts(AutoConfig.from_pretrained(d).vocab_size)
        refs[arch] = (d, prompts, _hf_greedy(d, prompts, 40))
    return refs


@pytest.fixture(scope="module")
def smollm2() -> str:
    from kvloom.loader.model_source import default_model_path

    try:
        return str(default_model_path())
    except FileNotFoundError:
        pytest.skip("the SmolLM2 GGUF is not on this machine")


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2) -> list[list[int]]:
    from kvloom.loader.model_source import gguf_hf_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_hf_dir(smollm2))
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain how a bicycle stays upright.",
        "List three uses of copper.",
        "Why is the sky blue?",
        "Give me a recipe for pancakes.",
        "What does a compiler do?",
        "Tell me a short story about a robot who learns to paint.",
    ]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [list(tok(t, add_special_tokens=False).input_ids) for t in texts]


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_fp32_greedy_matches_hf(tiny_refs, arch, backend):
    _need(backend, torch.float32)
    d, prompts, expected = tiny_refs[arch]
    assert _kvloom_tokens(d, prompts, 40, "float32", backend) == expected


@pytest.mark.parametrize("backend", FP32_BACKENDS)
def test_smollm2_fp32_greedy_matches_hf(smollm2, smollm2_prompts, backend):
    _need(backend, torch.float32)
    prompts = smollm2_prompts[:4]
    expected = _hf_greedy(smollm2, prompts, 32)
    assert _kvloom_tokens(smollm2, prompts, 32, "float32", backend) == expected


@pytest.fixture(scope="module")
def hf_bf16_agreement(smollm2, smollm2_prompts) -> float:
    """HF's own bf16 greedy run, teacher-forced through HF's fp32 reference: the yardstick
    for what bf16 allows on this model (98.44% over these 1,024 tokens on the CPU)."""
    hf = _hf_model(smollm2, torch.bfloat16)
    generated = []
    with torch.no_grad():
        for p in smollm2_prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            generated.append(out[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return _top1_agreement(smollm2, smollm2_prompts, generated, torch.float32)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_smollm2_bf16_top1_agreement(smollm2, smollm2_prompts, hf_bf16_agreement, backend):
    """kvloom's bf16 greedy tokens (8 prompts x 128 tokens), each teacher-forced through HF
    on the same weights (prompt plus kvloom's tokens in one forward pass); a token agrees
    when HF ranks it first at its position. Two measures:

    - ``vs_hf_fp32``: HF in fp32. The issue asks for 99%; HF's own bf16 greedy run reaches
      ~98.4% by this measure (``hf_bf16_vs_fp32``, the ``hf_bf16_agreement`` fixture), so
      kvloom must reach 99% or come within half a point of HF's bf16. Asserted.
    - ``vs_hf_bf16``: HF in bf16 (on CUDA): how closely kvloom follows a bf16 implementation
      of the same model. Recorded, not asserted.

    Both go into one JSON line appended to $OUT/bf16_agreement.jsonl ($OUT defaults to /tmp)
    with the backend, the token count and ``hf_bf16_vs_fp32``."""
    _need(backend)
    generated = _kvloom_tokens(smollm2, smollm2_prompts, 128, "bfloat16", backend)
    tokens = sum(map(len, generated))
    assert tokens >= 1000
    agreement = _top1_agreement(smollm2, smollm2_prompts, generated, torch.float32)
    agreement_bf16 = _top1_agreement(smollm2, smollm2_prompts, generated, torch.bfloat16)
    print(f"{backend}: bf16 top-1 agreement over {tokens} tokens: with HF fp32 {agreement:.4f}, "
          f"with HF bf16 {agreement_bf16:.4f} (HF's own bf16 with HF fp32: {hf_bf16_agreement:.4f})")
    record = {
        "backend": backend,
        "tokens": tokens,
        "vs_hf_fp32": agreement,
        "vs_hf_bf16": agreement_bf16,
        "hf_bf16_vs_fp32": hf_bf16_agreement,
    }
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bf16_agreement.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    assert agreement >= min(0.99, hf_bf16_agreement - 0.005)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_cuda_graphs_match_eager(smollm2, smollm2_prompts, backend):
    _need(backend)
    # 5 requests: the decode batch is padded to the capture size 8.
    prompts = smollm2_prompts[:5]
    # The eager model in CUDA graphs (compilation rounds bf16 differently: its tokens are
    # held to the agreement criterion above, and to eager's in fp32 by test_compile_gpu).
    # A graph plans split-KV decode for max_model_len, an eager step for its longest
    # sequence; these requests (short prompts + 48 tokens) stay within one split's floor
    # (TRITON_ATTN's min_split_tokens, 256), so the plans give the same bits. Longer
    # requests may be cut differently, as in vLLM, and then round differently in bf16.
    graphs = _kvloom_tokens(smollm2, prompts, 48, "bfloat16", backend, torch_compile=False)
    eager = _kvloom_tokens(smollm2, prompts, 48, "bfloat16", backend, enforce_eager=True)
    assert graphs == eager


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_async_scheduling_matches_sync(smollm2, smollm2_prompts, backend):
    """Async scheduling changes when the host works, not what the device computes."""
    _need(backend)
    prompts = smollm2_prompts[:5]
    sync = _kvloom_tokens(smollm2, prompts, 48, "bfloat16", backend, async_scheduling=False)
    assert _kvloom_tokens(smollm2, prompts, 48, "bfloat16", backend, async_scheduling=True) == sync
    # The CUDA default (no flag) is async scheduling.
    assert _kvloom_tokens(smollm2, prompts, 48, "bfloat16", backend) == sync


def test_penalties_and_seeds_overlap_on_cuda(smollm2, smollm2_prompts, monkeypatch):
    """Penalised and seeded requests keep async scheduling's overlap on CUDA (the token in
    flight is counted on the device) and sample exactly the synchronous engine's tokens."""
    from kvloom import LLM, SamplingParams

    _need("TRITON_ATTN")
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the spy reads the core
    prompts = [{"prompt_token_ids": p} for p in smollm2_prompts[:6]]
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, top_p=0.95, max_tokens=48, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.3 * (i % 3), presence_penalty=0.2)
              for i in range(len(prompts))]  # fmt: skip
    results, depths = {}, []
    for flag in (False, True):
        llm = LLM(smollm2, dtype="bfloat16", attention_backend="TRITON_ATTN", kv_cache_memory=KV_MEMORY,
                  async_scheduling=flag)  # fmt: skip
        core = llm.llm_engine.engine_core.core
        launch = core.worker.execute_model

        def spy(so, core=core, launch=launch):
            pending = launch(so)
            depths.append(len(core._in_flight) + 1)
            return pending

        core.worker.execute_model = spy
        results[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        _free(llm)
    assert results[True] == results[False]
    assert depths.count(2) >= 40  # the async engine kept two steps in flight


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "pressure",
    [
        pytest.param({"max_num_batched_tokens": 32, "max_num_seqs": 8}, id="chunked"),
        pytest.param({"num_gpu_blocks_override": 48, "max_model_len": 512}, id="preemption"),
    ],
)
def test_scheduling_pressure_keeps_tokens(smollm2, smollm2_prompts, hf_bf16_agreement, backend, pressure):
    """With chunked prefill / preemption forced (prefix caching on): fp32 backends give the
    same tokens as without; bf16-only backends (batch composition changes bf16 rounding)
    are held to the bf16 agreement criterion over the same 1,024 tokens."""
    _need(backend)
    from kvloom.attention import selector
    from kvloom import plugins

    plugins.load_plugins()
    block = selector.get_attention_backend(backend).preferred_block_size(16)
    kwargs = dict(pressure)
    if "num_gpu_blocks_override" in kwargs:  # the same token capacity whatever the block size
        kwargs["num_gpu_blocks_override"] = max(kwargs["num_gpu_blocks_override"] * 16 // block, 512 // block + 1)
    if _usable(backend, torch.float32):
        prompts = smollm2_prompts[:6]
        base = _kvloom_tokens(smollm2, prompts, 40, "float32", backend, enforce_eager=True)
        assert _kvloom_tokens(smollm2, prompts, 40, "float32", backend, enforce_eager=True, **kwargs) == base
        return
    pressed = _kvloom_tokens(smollm2, smollm2_prompts, 128, "bfloat16", backend, enforce_eager=True, **kwargs)
    assert sum(map(len, pressed)) >= 1000
    agreement = _top1_agreement(smollm2, smollm2_prompts, pressed, torch.float32)
    print(f"{backend} {pressure}: bf16 top-1 agreement with HF fp32 {agreement:.4f} "
          f"(HF's own bf16: {hf_bf16_agreement:.4f})")
    assert agreement >= min(0.99, hf_bf16_agreement - 0.005)
