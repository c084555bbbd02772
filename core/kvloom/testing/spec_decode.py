"""Speculative decoding in a test: tiny draft checkpoints in HF's layout, and the checks a
proposer (kvloom's or a plugin's) is held to.

Checkpoints, made offline in seconds:

- ``make_tiny_eagle3_head(target_dir, out_dir)``: a random EAGLE-3 head for a tiny target
  (``config.json`` naming ``LlamaForCausalLMEagle3``, a smaller draft vocabulary mapped by
  ``d2t``, the layer as ``midlayer.*``, no ``embed_tokens``: the target's is shared);
- ``add_tiny_mtp_layer(model_dir)``: a random DeepSeek-V3 MTP layer
  (``model.layers.{num_hidden_layers}.*``) added to a tiny DeepSeek-V3 checkpoint, whose
  config then declares ``num_nextn_predict_layers: 1``.

The contract (``check_proposer``): with the proposer on, greedy decoding gives exactly the
target's tokens without it, drafts are verified (the engine counts them) and every draft it
returns obeys the request's ``num_drafts`` and the vocabulary (the engine refuses others).
``installed_proposer`` (``kvloom.testing.plugins``) makes a class under test look installed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ProposerCheck", "add_tiny_mtp_layer", "check_proposer", "in_process_engines", "make_tiny_eagle3_head"]


def _random_tensor(shape: Sequence[int], generator: torch.Generator, norm: bool = False) -> torch.Tensor:
    if norm:
        return 1.0 + 0.1 * torch.randn(*shape, generator=generator)
    return 0.1 * torch.randn(*shape, generator=generator)


def make_tiny_eagle3_head(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    draft_vocab_size: int = 256,
    layer_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> Path:
    """A random EAGLE-3 head for the tiny Llama-family target in ``target_dir``, in HF's
    layout (see the module docstring), saved into ``out_dir``; returns it. ``layer_ids``:
    the target hidden states it reads (HF ``output_hidden_states`` indices; default the
    embeddings, the middle and the final output: ``(0, L // 2, L)``)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaConfig

    target = AutoConfig.from_pretrained(target_dir)
    num_layers = target.num_hidden_layers
    ids = list(layer_ids) if layer_ids is not None else [0, num_layers // 2, num_layers]
    hidden, vocab = target.hidden_size, target.vocab_size
    heads, kv_heads = target.num_attention_heads, target.num_key_value_heads
    head_dim = getattr(target, "head_dim", None) or hidden // heads
    # The target's rotary embedding (transformers >= 5 keeps it in rope_parameters).
    rope = {"rope_parameters": target.rope_parameters} if getattr(target, "rope_parameters", None) else \
        {"rope_theta": getattr(target, "rope_theta", 10000.0)}  # fmt: skip
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=target.max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=False, **rope,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = draft_vocab_size
    config.eagle_aux_hidden_state_layer_ids = ids
    g = torch.Generator().manual_seed(seed)
    targets = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "fc.weight": _random_tensor((hidden, len(ids) * hidden), g),
        "midlayer.self_attn.q_proj.weight": _random_tensor((q, 2 * hidden), g),
        "midlayer.self_attn.k_proj.weight": _random_tensor((kv, 2 * hidden), g),
        "midlayer.self_attn.v_proj.weight": _random_tensor((kv, 2 * hidden), g),
        "midlayer.self_attn.o_proj.weight": _random_tensor((hidden, q), g),
        "midlayer.mlp.gate_proj.weight": _random_tensor((2 * hidden, hidden), g),
        "midlayer.mlp.up_proj.weight": _random_tensor((2 * hidden, hidden), g),
        "midlayer.mlp.down_proj.weight": _random_tensor((hidden, 2 * hidden), g),
        "midlayer.input_layernorm.weight": _random_tensor((hidden,), g, norm=True),
        "midlayer.hidden_norm.weight": _random_tensor((hidden,), g, norm=True),
        "midlayer.post_attention_layernorm.weight": _random_tensor((hidden,), g, norm=True),
        "norm.weight": _random_tensor((hidden,), g, norm=True),
        "lm_head.weight": _random_tensor((draft_vocab_size, hidden), g),
        "d2t": targets - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def add_tiny_mtp_layer(model_dir: str | Path, *, seed: int = 1) -> Path:
    """Add a random MTP layer to the tiny DeepSeek-V3 checkpoint in ``model_dir`` (in place):
    ``model.layers.{L}.*`` (a DeepSeek decoder layer, drawn by transformers, plus ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head``) in ``mtp.safetensors``, and
    ``num_nextn_predict_layers: 1`` in its config; returns ``model_dir``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from kvloom.testing.models import save_tiny_checkpoint

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    num_layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    prefix = f"model.layers.{num_layers}."
    with tempfile.TemporaryDirectory() as tmp:
        deeper = AutoConfig.from_pretrained(model_dir)
        deeper.num_hidden_layers = num_layers + 1
        save_tiny_checkpoint(deeper, tmp, seed=seed, tokenizer=False)
        tensors = {}
        for file in Path(tmp).glob("*.safetensors"):
            tensors.update({n: t for n, t in load_file(str(file)).items() if n.startswith(prefix)})
    g = torch.Generator().manual_seed(seed)
    tensors.update({
        prefix + "enorm.weight": _random_tensor((hidden,), g, norm=True),
        prefix + "hnorm.weight": _random_tensor((hidden,), g, norm=True),
        prefix + "eh_proj.weight": _random_tensor((hidden, 2 * hidden), g),
        prefix + "shared_head.norm.weight": _random_tensor((hidden,), g, norm=True),
        prefix + "shared_head.head.weight": _random_tensor((vocab, hidden), g),
        prefix + "embed_tokens.weight": _random_tensor((vocab, hidden), g),
    })  # fmt: skip
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(model_dir / "mtp.safetensors"))
    config_file = model_dir / "config.json"
    data = json.loads(config_file.read_text())
    data["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(data, indent=2))
    return model_dir


@contextmanager
def in_process_engines() -> Iterator[None]:
    """Engines built in the block run their engine core in this process
    (``KVLOOM_ENABLE_MULTIPROCESSING=0``): seconds faster to start, and a test can reach
    the scheduler (``llm.llm_engine.engine_core.core.scheduler``)."""
    before = os.environ.get("KVLOOM_ENABLE_MULTIPROCESSING")
    os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVLOOM_ENABLE_MULTIPROCESSING"]
        else:
            os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = before


@dataclass
class ProposerCheck:
    """What ``check_proposer`` saw."""

    tokens: list[list[int]]
    """The greedy tokens with speculation (equal to those without)."""
    num_draft_tokens: int
    """Drafts verified over the run."""
    num_accepted_tokens: int
    """Drafts accepted."""


def greedy_with_stats(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], int, int]:
    """Each prompt's greedy tokens (EOS ignored), stepped through ``llm`` (an in-process
    engine: ``in_process_engines``), and the drafts verified and accepted meanwhile."""
    from kvloom import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"check-{i}", {"prompt_token_ids": list(prompt)}, params)
    scheduler = engine.engine_core.core.scheduler
    drafted = accepted = 0
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        speculation = scheduler.speculation
        if speculation is not None:
            stats = speculation.take_stats()
            drafted, accepted = drafted + stats.num_draft_tokens, accepted + stats.num_accepted_tokens
    return [results[f"check-{i}"] for i in range(len(prompts))], drafted, accepted


def check_proposer(
    model: str | Path,
    speculative_config: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 24,
    **engine_kwargs: Any,
) -> ProposerCheck:
    """Hold a proposer to the contract on ``model`` (fp32, the engine in this process):
    greedy tokens with ``speculative_config`` equal those without, and drafts were verified.
    Raises ``AssertionError`` saying what differs. ``engine_kwargs`` go to both engines."""
    from kvloom import LLM

    kwargs = {"dtype": "float32", "kv_cache_memory": "32MiB", "disable_log_stats": True, **engine_kwargs}
    with in_process_engines():
        expected, _, _ = greedy_with_stats(LLM(str(model), **kwargs), prompts, max_tokens)
        spec = LLM(str(model), speculative_config=speculative_config, **kwargs)
        tokens, drafted, accepted = greedy_with_stats(spec, prompts, max_tokens)
    for i, (got, want) in enumerate(zip(tokens, expected)):
        assert got == want, f"prompt {i}: greedy tokens with {speculative_config} differ from the target's:\n{got}\n{want}"
    assert drafted > 0, f"no draft was verified with {speculative_config}"
    return ProposerCheck(tokens, drafted, accepted)
