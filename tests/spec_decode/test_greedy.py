"""Greedy decoding with each proposer gives exactly the target's tokens without speculation
(fp32, tiny models and SmolLM2 through its GGUF), and the drafts are really verified.

A draft model that *is* the target must have every draft accepted: that checks the draft
runner's KV cache (fed positions, shared block table, lookahead slots) end to end. The
EAGLE-3 head's drafts are checked against a plain-torch reference of the head over the
target's hidden states (HF transformers' ``output_hidden_states``).
"""

from __future__ import annotations

import codecs
import tempfile
import this

import pytest
import torch

from kvloom import LLM
from kvloom.testing.models import load_hf_model, make_tiny_model, random_prompts, tiny_model_dir
from kvloom.testing.spec_decode import add_tiny_mtp_layer, check_proposer, in_process_engines, make_tiny_eagle3_head

PROMPTS = random_prompts(512, lengths=(5, 23, 40))


def test_ngram_on_repetitive_prompts() -> None:
    # A prompt that repeats itself, and one of the tiny model's own greedy loops.
    loop = [5, 6, 7, 8, 9, 10] * 4
    check = check_proposer(tiny_model_dir("llama"), {"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                           [loop, *PROMPTS], max_tokens=32)  # fmt: skip
    assert check.num_accepted_tokens > 0


def test_a_draft_model_that_is_the_target_has_every_draft_accepted() -> None:
    target = tiny_model_dir("llama")
    check = check_proposer(target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
                           PROMPTS, max_tokens=24, max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    assert check.num_accepted_tokens == check.num_draft_tokens > 0


def test_an_independent_draft_model() -> None:
    draft = make_tiny_model("llama", tempfile.mkdtemp(), seed=3)
    check_proposer(tiny_model_dir("llama"), {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
                   PROMPTS)  # fmt: skip


def test_mtp_layer_of_deepseek_v3() -> None:
    model = add_tiny_mtp_layer(make_tiny_model("deepseek_v3", tempfile.mkdtemp(), num_nextn_predict_layers=1))
    check_proposer(model, {"method": "deepseek_mtp", "num_speculative_tokens": 2}, PROMPTS[:2], max_tokens=16)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate-half RoPE over ``x [N, heads, head_dim]``."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) / half)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None].float(), torch.cat([angles.sin()] * 2, -1)[:, None].float()
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def eagle3_reference_drafts(head_dir, target_dir, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after ``tokens``, computed the plain way: every position
    (the prompt's, then each draft's) attends causally to all before it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    w = load_file(f"{head_dir}/model.safetensors")
    cfg = AutoConfig.from_pretrained(head_dir)
    target = load_hf_model(target_dir)
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i][0] for i in cfg.eagle_aux_hidden_state_layer_ids], -1)
    embed = target.get_input_embeddings().weight
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    next_token = int(out.logits[0, -1].argmax())
    # Position p pairs the target's hidden states at p with the token at p + 1.
    inputs = [
        (tokens[p + 1] if p + 1 < len(tokens) else next_token, taps[p] @ w["fc.weight"].T) for p in range(len(tokens))
    ]
    keys, values, drafts = [], [], []
    L = "midlayer."
    for p in range(len(tokens) + k - 1):
        token, hidden = inputs[p]
        x = torch.cat([_rms(embed[token], w[L + "input_layernorm.weight"]), _rms(hidden, w[L + "hidden_norm.weight"])])
        pos = torch.tensor([p])
        q = _rope((x @ w[L + "self_attn.q_proj.weight"].T).view(1, heads, head_dim), pos, theta)[0]
        keys.append(_rope((x @ w[L + "self_attn.k_proj.weight"].T).view(1, kv_heads, head_dim), pos, theta)[0])
        values.append((x @ w[L + "self_attn.v_proj.weight"].T).view(kv_heads, head_dim))
        kk, vv = torch.stack(keys), torch.stack(values)  # [p + 1, kv_heads, head_dim]
        group = heads // kv_heads
        scores = torch.einsum("hd,phd->hp", q, kk.repeat_interleave(group, 1)) / head_dim**0.5
        attn = torch.einsum("hp,phd->hd", scores.softmax(-1), vv.repeat_interleave(group, 1)).reshape(-1)
        h = attn @ w[L + "self_attn.o_proj.weight"].T + hidden
        m = _rms(h, w[L + "post_attention_layernorm.weight"])
        m = torch.nn.functional.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T)
        prenorm = m @ w[L + "mlp.down_proj.weight"].T + h
        if p >= len(tokens) - 1:  # a draft
            draft_id = int((_rms(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            drafts.append(draft_id + int(w["d2t"][draft_id]))
            inputs.append((drafts[-1], prenorm))
    return drafts


def test_eagle3_head_drafts_match_a_reference_and_keep_greedy_output() -> None:
    target = tiny_model_dir("llama")
    head = make_tiny_eagle3_head(target, tempfile.mkdtemp())
    prompt = PROMPTS[1]
    with in_process_engines():
        llm = LLM(str(target), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True,
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})  # fmt: skip
        engine = llm.llm_engine
        from kvloom import SamplingParams

        engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
        engine.step()  # the prefill: its token, and the head's drafts after it
        request = engine.engine_core.core.scheduler.requests["r"]
        drafts = list(request.spec_token_ids)
    assert drafts == eagle3_reference_drafts(head, target, prompt, 3)
    check_proposer(target, {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}, PROMPTS)


@pytest.fixture(scope="module")
def zen() -> str:
    """Real text shipped with Python: the Zen of Python (``this``, rot13-encoded there)."""
    return codecs.decode(this.s, "rot13")


def test_smollm2_gguf_ngram_copies_text_exactly_as_without(zen: str) -> None:
    from transformers import AutoTokenizer

    from kvloom.loader.model_source import default_model_path, gguf_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_hf_dir(default_model_path()))
    text = zen.splitlines()[2:7]
    prompt = tokenizer.encode("Copy the text exactly.\n\n" + "\n".join(text) + "\n\nCopy:\n" + text[0] + "\n")
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    check = check_proposer(default_model_path(), spec, [prompt], max_tokens=24, max_model_len=256)
    # The copy is mostly accepted drafts.
    assert check.num_accepted_tokens >= 8 and check.num_accepted_tokens / check.num_draft_tokens > 0.3


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": str(tiny_model_dir("llama")), "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_preemption_and_prefix_caching_keep_greedy_output(spec: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 requests sharing a 32-token prefix need ~16 blocks of 16 tokens; 10 exist: requests are
    # preempted (their drafts dropped, their lookahead slots given back) and come back through
    # the prefix cache.
    from kvloom.scheduler.scheduler import Scheduler

    preempting: dict[int, Scheduler] = {}  # the schedulers (of the plain engine, of the speculating one) that preempted
    original = Scheduler._preempt

    def counting(self: Scheduler, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        preempting[id(self)] = self  # kept: no id reused
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    shared = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    prompts = [shared + p[:8] for p in PROMPTS] + [shared + [13, 14]]
    check = check_proposer(tiny_model_dir("llama"), spec, prompts, max_tokens=28, num_gpu_blocks_override=10,
                           max_model_len=96, block_size=16)  # fmt: skip
    assert len(preempting) == 2 and check.num_accepted_tokens > 0


def test_async_scheduling_with_speculation() -> None:
    # Speculating makes each step synchronous (the drafts follow the accepted tokens); an engine
    # asked for async scheduling still runs, with the same tokens.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    check = check_proposer(tiny_model_dir("llama"), spec, [[5, 6, 7, 8] * 5, *PROMPTS[:2]], async_scheduling=True)
    assert check.num_accepted_tokens > 0


def test_ngram_on_a_model_with_sliding_window_layers() -> None:
    # Gemma 2's local (16-token window) and global layers are two KV-cache groups: rejected
    # drafts' blocks go back in both, and the window's blocks are skipped as without drafts.
    model = tiny_model_dir("gemma2")
    loop = [5, 6, 7, 8, 9, 10, 11] * 7  # 49 tokens: three windows
    check = check_proposer(model, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                           [loop, *random_prompts(512, lengths=(43, 20))], max_tokens=32,
                           max_model_len=128)  # fmt: skip
    assert check.num_accepted_tokens > 0


def test_a_draft_model_beside_a_model_with_several_kv_cache_groups_is_refused() -> None:
    model = str(tiny_model_dir("gemma2"))
    with in_process_engines(), pytest.raises(ValueError, match="several KV-cache groups .* not supported yet"):
        LLM(model, dtype="float32", speculative_config={"method": "draft_model", "model": model,
                                                        "num_speculative_tokens": 2})  # fmt: skip
