"""Models in a test: tiny random HF checkpoints with real tokenizers, HF transformers'
reference tokens, and a model class built, loaded and run outside the engine.

Checkpoints, made offline in seconds (nothing is downloaded):

- ``make_tiny_model(arch, out_dir)``: a tiny random ``llama`` / ``mistral`` / ``qwen2`` /
  ``qwen3`` / ``qwen3_moe`` / ``mixtral`` checkpoint (``TINY_CONFIGS``) saved with HF ``save_pretrained``, with a real
  byte-level BPE tokenizer; ``tiny_model_dir(arch)`` makes one per process and reuses it;
- ``save_tiny_checkpoint(hf_config, out_dir)``: the same for any architecture transformers
  knows (a model plugin's: ``GraniteConfig(...)``), from a config you build;
- ``build_tokenizer()``: the tokenizer alone (eos, pad, a ChatML chat template).

References: ``hf_greedy_tokens(model_dir, prompts, n)`` (HF transformers' greedy tokens,
with a PEFT LoRA adapter when given one), ``load_hf_model`` and ``random_prompts``.

A model class outside the engine (for model authors' tests, ``kvloom.interfaces.models``):
``load_model`` builds the class from an ``EngineConfig`` (``kvloom.testing.resolve_engine_config``)
and loads a checkpoint's weights through its ``load_weights``; ``forward_context`` runs
``forward`` or single ``Attention`` layers with the attention backend's metadata for the step.

transformers, tokenizers and peft are imported inside the functions that use them, so
``import kvloom.testing`` stays light.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.forward_context import set_forward_context
from kvloom.loader.model_loader import construct_model, model_weights
from kvloom.quantization.context import process_weights_after_loading

__all__ = [
    "EOS_TOKEN",
    "TINY_ARCHITECTURES",
    "TINY_CONFIGS",
    "TINY_HYBRID_ARCHITECTURES",
    "TINY_MLA_ARCHITECTURES",
    "build_tokenizer",
    "forward_context",
    "hf_greedy_tokens",
    "load_hf_model",
    "load_model",
    "make_tiny_model",
    "random_prompts",
    "save_tiny_checkpoint",
    "tiny_hf_config",
    "tiny_model_dir",
]

# ---------------------------------------------------------------------- a model class in a test


def load_model(model_cls: type[nn.Module], config: EngineConfig, device: torch.device | str = "cpu") -> nn.Module:
    """``model_cls(config)`` built as the engine builds a model: on ``device`` in
    ``config.model.dtype``, its weights loaded by its ``load_weights`` from ``config``'s
    checkpoint (an HF directory or a GGUF file), in eval mode. The class need not be
    registered. A quantized checkpoint (``config.model.quantization``) is built and
    repacked as the engine does. (The engine also installs the platform's custom ops;
    this does not.)"""
    model = construct_model(model_cls, config, torch.device(device))
    model.load_weights(model_weights(config, model))
    process_weights_after_loading(model)
    return model.eval()


@contextmanager
def forward_context(attn_metadata: Any, **extras: Any) -> Iterator[None]:
    """Inside the block, ``Attention`` layers (and the models built from them) run one
    step with ``attn_metadata``, what the attention backend's metadata builder built for
    it (``builder.build(common)``); the model runner wraps every forward in the same
    context. ``extras`` are per-step data other layers read (e.g. LoRA's mapping)."""
    with set_forward_context(attn_metadata, **extras):
        yield


# ---------------------------------------------------------------------- tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello world! This is a tiny tokenizer for kvloom tests.",
    "Large language models predict the next token from the previous tokens.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "user assistant system: please answer the question briefly.",
]
EOS_TOKEN = "<|endoftext|>"
"""The eos (and pad) token of ``build_tokenizer``'s tokenizer."""
_SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A real tokenizer made offline: byte-level BPE (any text encodes) trained on a tiny
    English corpus, as a transformers ``PreTrainedTokenizerFast`` with ``EOS_TOKEN`` as eos
    and pad token and a ChatML chat template (``<|im_start|>role ... <|im_end|>``).
    ``vocab_size`` includes the special tokens; keep it at most the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = _CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------------- tiny checkpoints

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        model_type="mistral", vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        rope_theta=50000.0, sliding_window=4096, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=600, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    # MLA (multi-head latent attention). V2: q_lora_rank None (V2-Lite's shape),
    # interleaved RoPE. V3: q_lora_rank set, DeepSeek's YaRN (mscale, mscale_all_dim).
    "deepseek_v2": dict(
        model_type="deepseek_v2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, max_position_embeddings=256, rope_theta=10000.0,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
        ),
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "mixtral": dict(
        model_type="mixtral", vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
    ),
    # Hybrid models: sliding-window and full-attention layers (several KV-cache groups).
    "gemma2": dict(
        model_type="gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
        max_position_embeddings=512, rope_theta=10000.0, sliding_window=16, attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0, tie_word_embeddings=True,
    ),
    "gemma3": dict(
        model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24,
        max_position_embeddings=512, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip
"""The config fields of each tiny architecture (``model_type`` plus HF config fields): a few
layers of width 64 that still exercise GQA (fewer KV heads than heads), head dims that
differ from ``hidden_size / heads`` (mistral, qwen3), tied and untied LM heads, biases
(qwen2), q/k norms (qwen3), mixtures of 8 experts (qwen3_moe: top-3 renormalised, layer 1
dense through ``mlp_only_layers``; mixtral: top-2), MLA (deepseek_v2/v3: latent rank 32,
rope 16, 4 experts top-2 plus a shared expert after the first layer), and hybrid models of
sliding-window (16 tokens) and full-attention layers: gemma2 (alternating, both logit
soft-caps), gemma3 (three windowed layers and one full, q/k norms, RoPE per layer type) and
gpt_oss (alternating, attention sinks, 4 experts top-2 with biases, YaRN)."""

TINY_MLA_ARCHITECTURES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3")
"""The tiny MLA models (multi-head latent attention, ``use_mla``; DeepSeek MoE after the
first layer): ``deepseek_v2``, ``deepseek_v3``; ``make_tiny_model`` and ``tiny_model_dir``
take them too."""

TINY_ARCHITECTURES: tuple[str, ...] = tuple(a for a in TINY_CONFIGS if a not in TINY_MLA_ARCHITECTURES)
"""The standard-attention tiny models: ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``qwen3_moe``, ``mixtral``, and the hybrid ``gemma2``, ``gemma3``, ``gpt_oss``."""

TINY_HYBRID_ARCHITECTURES: tuple[str, ...] = ("gemma2", "gemma3", "gpt_oss")
"""The tiny models with sliding-window and full-attention layers (several KV-cache groups)."""


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of the tiny ``arch`` model (``TINY_CONFIGS``), ``overrides``
    on top, with ``initializer_range`` 0.1 (HF's 0.02 makes a tiny model's greedy output
    collapse to one repeated token, which hides bugs) and ``rms_norm_eps`` 1e-6."""
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch: {arch!r} is not a tiny architecture (known: {', '.join(TINY_ARCHITECTURES)})")
    kwargs = dict(TINY_CONFIGS[arch])
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    kwargs.setdefault("initializer_range", 0.1)
    kwargs.setdefault("rms_norm_eps", 1e-6)
    return AutoConfig.for_model(model_type, **kwargs)


def save_tiny_checkpoint(hf_config: Any, out_dir: str | Path, *, seed: int = 0, tokenizer: bool = True) -> Path:
    """Save a random model of ``hf_config`` (any transformers config: ``LlamaConfig``, a
    ``GraniteConfig`` for a model plugin, ...) into ``out_dir`` with ``save_pretrained``, in
    float32, and return the directory. Weights are drawn from ``seed`` by transformers'
    initialisation, then every bias is drawn from N(0, 0.1) and every norm weight from
    1 + N(0, 0.1) (HF starts them at 0 and 1, which would hide mistakes in them). With
    ``tokenizer``, ``build_tokenizer()`` is saved beside it and the config's eos, bos and
    pad token ids are set to its eos token. Keep ``initializer_range`` around 0.1 in the
    config for outputs that depend on the context."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tok = build_tokenizer() if tokenizer else None
    if tok is not None:
        hf_config.eos_token_id = tok.eos_token_id
        hf_config.pad_token_id = tok.pad_token_id
        hf_config.bos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    if tok is not None:
        tok.save_pretrained(out_dir)
    return out_dir


def make_tiny_model(
    arch: str, out_dir: str | Path, seed: int = 0, with_tokenizer: bool = True, **overrides: Any
) -> Path:
    """Save a tiny random ``arch`` model (``TINY_ARCHITECTURES``, ``TINY_MLA_ARCHITECTURES``;
    see ``TINY_CONFIGS``), with ``build_tokenizer()``'s tokenizer unless ``with_tokenizer`` is
    False, into ``out_dir``; returns the directory. ``overrides`` change config fields
    (``tiny_hf_config``). Takes a second or two on a CPU."""
    return save_tiny_checkpoint(tiny_hf_config(arch, **overrides), out_dir, seed=seed, tokenizer=with_tokenizer)


_TINY_ROOT: Path | None = None


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str) -> Path:
    """The tiny ``arch`` model with its tokenizer (``make_tiny_model(arch, ...)``, seed 0),
    made once per process in a temporary directory removed at exit, and shared: copy it
    (or call ``make_tiny_model``) before changing its files. Its served model name is
    ``arch`` (the directory's name)."""
    global _TINY_ROOT
    if _TINY_ROOT is None:
        _TINY_ROOT = Path(tempfile.mkdtemp(prefix="kvloom-tiny-models-"))
        atexit.register(shutil.rmtree, _TINY_ROOT, True)
    return make_tiny_model(arch, _TINY_ROOT / arch)


# ---------------------------------------------------------------------- references


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> nn.Module:
    """The HF transformers causal LM of ``model_dir`` in ``dtype`` with eager attention, in
    eval mode (``kwargs`` go to ``from_pretrained``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager", **kwargs).eval()


def hf_greedy_tokens(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], n: int, *, adapter_dir: str | Path | None = None
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (token ids), exactly ``n`` tokens
    (eos does not stop it: compare with kvloom's ``SamplingParams(temperature=0,
    max_tokens=n, ignore_eos=True)``), in float32 with eager attention. With
    ``adapter_dir``, through that PEFT LoRA adapter (peft's ``PeftModel``)."""
    model = load_hf_model(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outs.append(out[0, len(p) :].tolist())
    return outs


def random_prompts(vocab: int, lengths: Sequence[int] = (5, 16, 23, 41, 64), seed: int = 1234) -> list[list[int]]:
    """Random prompts of token ids in ``[3, vocab)`` (the low ids, often special tokens,
    left out), one per length; the default lengths cross 16-token block boundaries in
    different ways. The same ``seed`` gives the same prompts."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
