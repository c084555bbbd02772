"""Pooling (embedding) runners against HF transformers: a causal-LM checkpoint served with
runner="pooling" and a headless checkpoint (``Qwen3Model`` / ``LlamaModel``), LAST and MEAN
pooling (MEAN across prefill chunks), normalisation and ``dimensions``, LLM.embed/encode,
and the errors for the wrong runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvloom import LLM, SamplingParams
from kvloom.sampling_params import PoolingParams
from tests.helpers.model_fixtures import make_hf_config, tiny_model_dir

PROMPTS = [[5, 17, 33, 48, 90, 11, 3, 8, 200, 201, 202, 17, 18, 19, 20, 21, 22, 23, 24, 25], [7, 8, 9], [300]]
TOL = 1e-4


def hf_hidden(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).last_hidden_state[0].double()


def reference(model_dir: Path, pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    out = []
    for ids in PROMPTS:
        hidden = hf_hidden(model_dir, ids)
        pooled = hidden.mean(0) if pooling == "MEAN" else hidden[-1]
        out.append(F.normalize(pooled, dim=0) if normalize else pooled)
    return out


def assert_close(actual: list[list[float]] | list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        a = torch.as_tensor(a, dtype=torch.float64)
        assert a.shape == e.shape
        err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-6)
        assert err <= TOL, f"relative error {err:.3g}"


@pytest.fixture(scope="module")
def headless_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved as HF ``LlamaModel`` (no LM head; weight names without ``model.``)."""
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path_factory.mktemp("headless") / "llama"
    model = AutoModel.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    assert type(model).__name__ == "LlamaModel"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(out)
    return out


def test_causal_lm_as_embedding_model_last_token(tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3")
    llm = LLM(str(model_dir), runner="pooling", pooling_type="LAST", dtype="float32")
    assert llm.config.model.runner == "pooling"
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert_close([o.outputs.embedding for o in outs], reference(model_dir, "LAST"))
    # Generation is refused on a pooling model.
    with pytest.raises(ValueError, match="pooling .*cannot generate"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)


def test_headless_checkpoint_mean_pooling_across_chunks(headless_llama: Path) -> None:
    # Chunks of 8 tokens: the 20-token prompt is pooled over three prefill steps.
    llm = LLM(str(headless_llama), pooling_type="MEAN", dtype="float32", max_num_batched_tokens=8, max_num_seqs=4)
    assert llm.config.model.runner == "pooling"  # auto: "LlamaModel" is a pooling architecture
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert_close([o.outputs.embedding for o in outs], reference(headless_llama, "MEAN"))
    # Per-request overrides: LAST pooling without normalisation, truncated dimensions.
    raw = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type="LAST", normalize=False),
                     use_tqdm=False)  # fmt: skip
    assert_close([o.outputs.data for o in raw], reference(headless_llama, "LAST", normalize=False))
    short = llm.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16, normalize=False), use_tqdm=False)
    expected = hf_hidden(headless_llama, PROMPTS[0]).mean(0)[:16]  # the model default (MEAN), truncated
    assert_close([short[0].outputs.data], [expected])


def test_text_prompts_are_tokenized_like_hf(headless_llama: Path) -> None:
    from transformers import AutoTokenizer

    llm = LLM(str(headless_llama), pooling_type="MEAN", dtype="float32")
    texts = ["The quick brown fox", "Hello world!"]
    ids = [AutoTokenizer.from_pretrained(headless_llama)(t).input_ids for t in texts]
    expected = [F.normalize(hf_hidden(headless_llama, i).mean(0), dim=0) for i in ids]
    assert_close([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], expected)


def test_encode_needs_a_pooling_model() -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.encode("hi", use_tqdm=False)


def test_headless_qwen2_architecture_is_registered(tmp_path: Path) -> None:
    """``Qwen2Model`` checkpoints (biases on q/k/v) load and pool like HF."""
    from transformers import AutoModel

    config = make_hf_config("qwen2")
    config.architectures = ["Qwen2Model"]
    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, pooling_type="LAST", dtype="float32")
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert_close([o.outputs.embedding for o in outs], reference(tmp_path, "LAST"))


def test_io_processor_contract_is_what_kvloom_calls() -> None:
    """Every method an IO processor plugin may implement is one kvloom calls (LLM.encode:
    parse_data, pre_process, merge_pooling_params, post_process; POST /pooling: the async
    variants). merge_sampling_params was never called (IO processors wrap pooling only)."""
    from kvloom.interfaces import IOProcessor

    public = {name for name in dir(IOProcessor) if not name.startswith("_")}
    assert public == {"parse_data", "merge_pooling_params", "pre_process", "pre_process_async",
                      "post_process", "post_process_async"}  # fmt: skip
