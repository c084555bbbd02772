"""Tiny random HF models (with real tokenizers) and helpers to run kvloom models in tests.

The tiny checkpoints, the tokenizer and HF transformers' references are
``kvloom.testing.models``' (shipped with kvloom for plugin authors; re-exported here
under the names kvloom's tests use): ``make_tiny_model``, ``tiny_model_dir``,
``save_tiny_checkpoint``, ``build_tokenizer``, ``make_hf_config`` (``tiny_hf_config``),
``load_hf_model``, ``hf_greedy_tokens``, ``random_prompts``, ``ARCHITECTURES``,
``TINY_CONFIGS``, ``EOS_TOKEN``. What only kvloom's own tests use lives here:

* ``make_test_engine_config(model)`` builds an ``EngineConfig`` directly (a stand-in
  platform, no plugins) whose attention backend is the given class (default: the test
  ``ReferenceBackend``).
* ``hf_logits`` / ``assert_logits_close``: the HF reference and the comparison the parity tests use.
* ``PagedRunner`` drives a kvloom model step by step the way the model runner does
  (KV caches bound to the ``Attention`` layers, contiguous blocks per request, slot
  mapping, ``CommonAttentionMetadata``, forward context) and returns logits.
"""

from __future__ import annotations

import functools
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
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.forward_context import set_forward_context
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from kvloom.platforms.interface import Platform
from kvloom.testing.models import (
    EOS_TOKEN,
    TINY_ARCHITECTURES,
    TINY_CONFIGS,
    build_tokenizer,
    hf_greedy_tokens,
    load_hf_model,
    make_tiny_model,
    random_prompts,
    save_tiny_checkpoint,
    tiny_model_dir,
)
from kvloom.testing.models import tiny_hf_config as make_hf_config
from kvloom.platforms.worker import Worker
from tests.helpers.reference_backend import ReferenceBackend

ARCHITECTURES = TINY_ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "EOS_TOKEN",
    "TINY_CONFIGS",
    "PagedRunner",
    "assemble_engine_config",
    "assert_logits_close",
    "build_tokenizer",
    "hf_greedy_tokens",
    "hf_logits",
    "load_hf_model",
    "make_hf_config",
    "make_test_engine_config",
    "make_tiny_model",
    "random_prompts",
    "save_tiny_checkpoint",
    "stand_in_platform",
    "tiny_async_llm",
    "tiny_model_dir",
]

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
        logits = self.model.compute_logits(hidden).float()
        return {req: logits[query_start[i] : query_start[i + 1]] for i, req in enumerate(scheduled)}


def tiny_async_llm(model_dir: str | Path) -> Any:
    """An ``AsyncLLM`` on ``model_dir`` in fp32 with a small KV cache (32 MiB), stats off."""
    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    )


def greedy_counting_preemptions(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens (EOS ignored) stepped through ``llm``'s engine with the
    engine core in this process, and how many preemptions the scheduler made meanwhile (the
    tests that force preemption check it really happened)."""
    from kvloom import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    preemptions, results = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        preemptions += engine.engine_core.core.scheduler.make_stats().num_preemptions
    return [results[str(i)] for i in range(len(prompts))], preemptions
