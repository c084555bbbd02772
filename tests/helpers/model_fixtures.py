"""Tiny random HF models (with real tokenizers) and helpers to run kvloom models in tests.

Reusable by any test module:

* ``make_tiny_model(arch, out_dir)`` saves a tiny random Llama / Mistral / Qwen2 / Qwen3
  (GQA, non-default head dims, ``initializer_range`` 0.1 (see ``make_hf_config``), random
  biases and norm weights, fp32) with ``save_pretrained``, plus a small byte-level BPE
  tokenizer with an eos token and a ChatML chat template.
* ``tiny_model_dir(arch)`` makes that model once per session and returns its directory.
* ``make_test_engine_config(model)`` builds an ``EngineConfig`` directly (a stand-in
  platform, no plugins) whose attention backend is the given class (default: the test
  ``ReferenceBackend``).
* ``hf_logits`` / ``assert_logits_close``: the HF reference and the comparison the parity tests use.
* ``PagedRunner`` drives a kvloom model step by step the way the model runner does
  (KV caches bound to the ``Attention`` layers, contiguous blocks per request, slot
  mapping, ``CommonAttentionMetadata``, forward context) and returns logits.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvloom.attention.backend import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata
from kvloom.attention.layer import Attention
from kvloom.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvloom.forward_context import set_forward_context
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from kvloom.platforms.interface import Platform
from kvloom.worker.worker import Worker

from tests.helpers.reference_backend import ReferenceBackend

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
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on a tiny corpus (any text encodes), wrapped as
    a transformers ``PreTrainedTokenizerFast`` with eos and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------------- tiny models

#: Per-architecture config overrides. Sizes are tiny but exercise GQA (kv heads < heads),
#: head dims that differ from hidden/heads, tied and untied LM heads, biases and q/k norm.
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
}
ARCHITECTURES = tuple(TINY_CONFIGS)


def make_hf_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[arch])
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    # Not HF's default 0.02: at 0.02 a 3-layer model's greedy output collapses to one
    # repeated token (1 distinct token in 24), which hides bugs; at 0.1 it gives ~20
    # distinct, context-dependent tokens in 24.
    kwargs.setdefault("initializer_range", 0.1)
    kwargs.setdefault("rms_norm_eps", 1e-6)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_model(
    arch: str, out_dir: str | Path, seed: int = 0, with_tokenizer: bool = True, **overrides: Any
) -> Path:
    """Save a tiny random ``arch`` model (``llama``, ``mistral``, ``qwen2``, ``qwen3``)
    into ``out_dir``; returns the directory. ``overrides`` change config fields."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = make_hf_config(arch, **overrides)
    tokenizer = build_tokenizer() if with_tokenizer else None
    if tokenizer is not None:
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # HF initialises biases to 0 and norms to 1, which would hide mistakes in them.
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


_TINY_ROOT: Path | None = None


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str) -> Path:
    """A tiny ``arch`` model with tokenizer, made once per test session (shared, read-only:
    tests that modify files must copy it or call ``make_tiny_model`` themselves)."""
    global _TINY_ROOT
    if _TINY_ROOT is None:
        _TINY_ROOT = Path(tempfile.mkdtemp(prefix="kvloom-tiny-models-"))
        atexit.register(shutil.rmtree, _TINY_ROOT, True)
    return make_tiny_model(arch, _TINY_ROOT / arch)


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager", **kwargs).eval()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within ``rel`` of the logit scale, and the same argmax per row."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= rel * max(scale, 1.0), f"max abs diff {diff:.3g} (logit scale {scale:.3g})"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------- engine config


@functools.cache
def stand_in_platform(device_type: str = "cpu") -> type[Platform]:
    """A platform for configs built by hand: ``device_type``, no custom ops, the generic
    worker. (Tests that need the real platform plugins resolve them.)"""

    class TestPlatform(Platform):
        name = f"test-{device_type}"

        @classmethod
        def is_available(cls) -> bool:
            return True

        @classmethod
        def get_attn_backend_priority(cls, use_mla: bool, capability: object) -> list:
            return []

        @classmethod
        def get_worker_cls(cls) -> type[Worker]:
            return Worker

    TestPlatform.device_type = device_type
    return TestPlatform


def make_test_engine_config(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    backend_cls: type[AttentionBackend] = ReferenceBackend,
    max_model_len: int | None = None,
    block_size: int = 16,
    load_format: str = "auto",
    seed: int = 0,
    skip_tokenizer_init: bool = False,
    device_type: str = "cpu",
) -> EngineConfig:
    """An ``EngineConfig`` for ``model`` (HF directory or .gguf) built section by section,
    with ``backend_cls`` as its attention backend (test backends are not plugins)."""
    source = resolve_model_source(str(model), load_format)
    hf_config = load_hf_config(source)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    max_len = max_model_len or text_config.max_position_embeddings
    model_config = ModelConfig(
        model=source.path,
        tokenizer=source.tokenizer_path,
        skip_tokenizer_init=skip_tokenizer_init,
        served_model_name=source.display_name,
        hf_config=hf_config,
        architecture=hf_config.architectures[0],
        dtype=dtype,
        max_model_len=max_len,
        seed=seed,
        runner="generate",
    )
    return assemble_engine_config(
        model_config,
        backend_cls=backend_cls,
        block_size=block_size,
        load_format=load_format,
        source_kind=source.kind,
        device_type=device_type,
    )


def assemble_engine_config(
    model: ModelConfig,
    *,
    backend_cls: type[AttentionBackend] = ReferenceBackend,
    block_size: int = 16,
    enable_prefix_caching: bool = False,
    num_blocks: int | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int | None = None,
    policy: str = "fcfs",
    load_format: str = "auto",
    source_kind: str = "hf",
    lora_modules: dict[str, str] | None = None,
    max_lora_rank: int = 16,
    disable_log_stats: bool = True,
    device_type: str = "cpu",
) -> EngineConfig:
    """The other sections of a test ``EngineConfig`` around ``model``: eager (no CUDA
    graphs), FCFS unless told otherwise, LoRA on when ``lora_modules`` are given, the
    stand-in platform of ``device_type``, ``backend_cls`` as the attention backend.
    ``max_num_batched_tokens`` defaults to ``max(2048, max_model_len)``."""
    max_len = model.max_model_len
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=block_size, user_specified_block_size=True, gpu_memory_utilization=0.9,
            kv_cache_memory=None, num_gpu_blocks_override=None, cache_dtype="auto",
            enable_prefix_caching=enable_prefix_caching, prefix_caching_hash_algo="sha256", num_blocks=num_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens or max(2048, max_len),
            max_model_len=max_len, long_prefill_token_threshold=0, enable_chunked_prefill=True, policy=policy,
        ),
        parallel=ParallelConfig(),
        attention=AttentionConfig(requested_backend=None, backend=backend_cls),
        load=LoadConfig(load_format=load_format, source_kind=source_kind),
        compilation=CompilationConfig(
            optimization_level=0, enforce_eager=True, cudagraph_mode=CUDAGraphMode.NONE, cudagraph_capture_sizes=[]
        ),
        lora=LoRAConfig(
            enable_lora=bool(lora_modules), max_loras=1, max_lora_rank=max_lora_rank, max_cpu_loras=1,
            lora_modules=lora_modules or {},
        ),
        observability=ObservabilityConfig(disable_log_stats=disable_log_stats, log_stats_interval=5.0),
        device=DeviceConfig(platform=stand_in_platform(device_type), device_type=device_type),
    )


# ---------------------------------------------------------------------- paged runner


class PagedRunner:
    """Runs a kvloom model over a paged KV cache, one scheduled step at a time.

    Each request gets ``blocks_per_request`` contiguous physical blocks (in reverse
    order, so block ids differ from logical indices). ``step({req: new_tokens})`` feeds
    each request's next tokens and returns ``{req: float32 logits [len(new_tokens), V]}``.
    """

    def __init__(
        self, model: nn.Module, config: EngineConfig, max_requests: int = 8, blocks_per_request: int | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = config.cache.block_size
        self.blocks_per_request = blocks_per_request or -(-config.model.max_model_len // self.block_size)
        num_blocks = max_requests * self.blocks_per_request
        self.device = next(model.parameters()).device
        backend = config.attention.backend
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = layers[0]
        shape = backend.get_kv_cache_shape(num_blocks, self.block_size, first.num_kv_heads, first.head_size)
        for layer in layers:
            layer.kv_cache = torch.zeros(shape, dtype=config.model.dtype, device=self.device)
        spec = AttentionLayerSpec(
            num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, head_size=first.head_size,
            dtype=config.model.dtype, kv_cache_dtype=config.model.dtype, block_size=self.block_size,
            max_num_seqs=max_requests, max_model_len=config.model.max_model_len, scale=first.scale,
        )
        self.builder = backend.get_builder_cls()(spec, self.device, self.blocks_per_request)
        self.max_requests = max_requests
        self.rows: dict[Any, int] = {}
        self.num_computed: dict[Any, int] = {}

    def _block_row(self, row: int) -> list[int]:
        first = (self.max_requests - 1 - row) * self.blocks_per_request
        return list(range(first, first + self.blocks_per_request))

    @torch.inference_mode()
    def step(self, scheduled: dict[Any, list[int]]) -> dict[Any, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        table: list[list[int]] = []
        for req, tokens in scheduled.items():
            if req not in self.rows:
                self.rows[req] = len(self.rows)
                self.num_computed[req] = 0
            blocks = self._block_row(self.rows[req])
            start = self.num_computed[req]
            for j, tok in enumerate(tokens):
                pos = start + j
                input_ids.append(tok)
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            table.append(blocks)
            self.num_computed[req] = start + len(tokens)
        dev = self.device
        qsl_cpu = torch.tensor(query_start, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=seq_cpu.to(dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_reqs=len(scheduled),
            num_actual_tokens=len(input_ids),
            max_query_len=max(len(t) for t in scheduled.values()),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        metadata = self.builder.build(common)
        with set_forward_context(metadata):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
            )
        logits = self.model.compute_logits(hidden)
        return {req: logits[query_start[i] : query_start[i + 1]] for i, req in enumerate(scheduled)}


def random_prompts(vocab: int) -> list[list[int]]:
    """Five random prompts of token ids in [3, vocab) whose lengths cross block boundaries."""
    g = torch.Generator().manual_seed(1234)
    # Lengths chosen to cross block boundaries (block size 16) in different ways.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 16, 23, 41, 64)]


def hf_greedy_tokens(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, exactly ``n`` tokens (no eos)."""
    model = load_hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def tiny_async_llm(model_dir: str | Path) -> Any:
    """An ``AsyncLLM`` on ``model_dir`` in fp32 with a small KV cache (32 MiB), stats off."""
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    )
