"""The model runner: one step's inputs, the forward pass, sampling.

Per step it (1) applies the scheduler's differences to the persistent ``InputBatch``,
(2) flattens the scheduled tokens of all requests into one batch (input ids, positions,
slot mapping, query_start_loc, seq_lens, block table), (3) asks the attention backend's
builder for metadata, (4) runs the model (replaying a CUDA graph for uniform decode
batches when graphs are on), (5) computes last-token logits and samples, and (6) records
the sampled tokens in its own copy of each request.

``execute_model_async`` returns before the sampled tokens reach the host (async
scheduling): the tokens are copied into pinned memory behind an event, and the runner's
copy of each request holds a placeholder (-1) until the step's ``AsyncModelRunnerOutput``
fills it (``get_output()``). A step launched meanwhile reads such a token as input
straight from the previous step's sampled tensor on the device. A step whose structured
requests' bitmask waits for such tokens (``pending_structured_output_tokens``) is split:
``execute_model_async`` runs the forward and keeps the logits on the device, and
``sample_tokens`` masks and samples them once the engine core has the bitmask.

Platforms drive the runner through its methods: ``profile_peak_memory`` (KV-cache sizing)
and ``capture_cudagraphs`` besides the setup and step calls of the generic worker.

Per-request isolation: the work that belongs to one request (setting up its state, its
LoRA adapter, its row of the sampling state, its prompt logprobs, its pooling) runs under
``_request_work``: a failure there fails that request alone (``ModelRunnerOutput.failed``,
which the scheduler turns into ``FinishReason.ERROR``), and the rest of the batch goes on
with the tokens it would have had anyway. A batch whose sampling fails is sampled again
row by row to find the requests at fault. A failed request is left out of every later
step until the scheduler reports it finished. Only a failure that belongs to no request
(the forward pass, the logits) escapes and takes the engine down.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.attention.mla_metadata import MLAMetadataBuilder
from kvloom.compilation.backend import PiecewiseBackend, compile_forward
from kvloom.compilation.cache import use_compile_cache
from kvloom.compilation.cuda_graph import CUDAGraphWrapper
from kvloom.config import EngineConfig
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.distributed import parallel_state
from kvloom.distributed.pipeline import IntermediateTensors
from kvloom.forward_context import BatchDescriptor, set_forward_context
from kvloom.layers.custom_ops import get_custom_op
from kvloom.loader.model_loader import get_model
from kvloom.lora.manager import LoRAManager
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput, TokenLogprobs
from kvloom.pooling.pooler import pool_request
from kvloom.sample.metadata import SamplingMetadata
from kvloom.sample.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.output import GrammarOutput, SchedulerOutput
from kvloom.structured_output.bitmask import apply_grammar_bitmask
from kvloom.utils import cdiv
from kvloom.worker.cudagraph import CUDAGraphRunner
from kvloom.worker.cudagraph_dispatcher import CudagraphDispatcher, resolve_cudagraph_mode
from kvloom.worker.input_batch import CachedRequestState, InputBatch, Placeholders

logger = logging.getLogger(__name__)


class DeviceMemory(Protocol):
    """The allocator calls a memory profile makes; the ``torch.cuda`` module has them."""

    def synchronize(self) -> None: ...

    def reset_peak_memory_stats(self) -> None: ...

    def max_memory_allocated(self) -> int: ...

    def empty_cache(self) -> None: ...


def _step_seed(seed: int, num_output_tokens: int) -> int:
    return (seed * 1_000_003 + num_output_tokens * 7_919 + 1) % (2**63 - 1)


@dataclass
class StepBatch:
    """The flattened inputs of one step (host side) plus what postprocessing needs."""

    req_ids: list[str]
    states: list[CachedRequestState]
    num_tokens: int
    query_lens: np.ndarray  # [B]
    seq_lens: np.ndarray  # [B]
    logits_indices: np.ndarray  # [B]: index of each request's last scheduled token
    uniform_decode: bool
    rows: np.ndarray  # [B]: each request's row in the input batch
    #: Whether some request of the step wants prompt logprobs.
    any_prompt_logprobs: bool = False
    #: Scheduled requests left out of the step because their own work failed.
    failed_req_ids: list[str] = field(default_factory=list)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache. On the host it is left uninitialised: zero-filling touches
    every page (seconds and the whole cache in RSS at start); the attention backends
    never read a slot before writing it (their masks hide the rest, and
    tests/worker/test_kv_cache_uninitialised.py checks it with NaN-filled caches).
    Device memory is cleared, as it is cheap there."""
    if device.type == "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    """One device's model, KV cache and step (see the module docstring).

    A worker builds it in ``init_device`` and drives it through its public methods:
    ``load_model``, ``kv_cache_bytes_per_block``, ``initialize_kv_cache``,
    ``dummy_forward`` (warm-up), ``execute_model`` / ``execute_model_async`` per step, and,
    on devices that need them, ``profile_peak_memory`` (KV-cache sizing) and
    ``capture_cudagraphs`` (decode graphs). Its other attributes are its own."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.backend = config.attention.backend
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_model_len = config.model.max_model_len
        self.max_num_tokens = max(config.scheduler.max_num_batched_tokens, self.max_num_reqs)
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.pin_memory = device.type == "cuda"

        self.model: nn.Module | None = None
        # Pipeline parallelism: the first stage embeds the tokens, the last samples; the
        # others receive and send IntermediateTensors (kvloom.distributed.pipeline).
        self.pp_first, self.pp_last = parallel_state.is_first_stage(), parallel_state.is_last_stage()
        self._pp_send: tuple[Any, torch.Tensor] | None = None  # the send in progress and its buffer
        self.attn_layers: list[Attention | MLAAttention] = []
        self.kv_caches: list[torch.Tensor] = []
        self.builder = None
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req)


        self.sampler = Sampler()
        self.cudagraphs: CUDAGraphRunner | None = None  # full decode graphs, set by capture_cudagraphs()
        # torch.compile (set up by load_model when compilation.compile_model is on).
        self.compile_backend: PiecewiseBackend | None = None
        self._compiled_forward: Any = None
        self._attn_by_name: dict[str, Attention] | None = None
        self.compile_seconds = 0.0
        # CUDA graphs: the dispatcher decides each step's runtime mode and key; all graphs
        # share one memory pool (kvloom.compilation.cuda_graph explains why that is safe).
        comp = config.compilation
        mode, _ = resolve_cudagraph_mode(
            comp.cudagraph_mode,
            self.backend.cudagraph_support,
            comp.compile_model,
            config.device.platform.supports_cuda_graphs and device.type == "cuda",
        )
        self.dispatcher = CudagraphDispatcher(
            mode, comp.cudagraph_capture_sizes, self.max_num_reqs, self.max_num_tokens
        )
        self.graph_pool: Any = None
        self.lora_manager = None  # a kvloom.lora.manager.LoRAManager when LoRA is enabled

        # Host staging buffers (pinned on CUDA) and persistent device buffers. CUDA graphs
        # read the device buffers, so they must never be reallocated.
        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=self.pin_memory)

        def dev(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        n, b = self.max_num_tokens, self.max_num_reqs
        self.input_ids_cpu, self.input_ids = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.positions_cpu, self.positions = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.slot_mapping_cpu, self.slot_mapping = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.query_start_loc_cpu, self.query_start_loc = host(b + 1, torch.int32), dev(b + 1, dtype=torch.int32)
        self.seq_lens_cpu, self.seq_lens = host(b, torch.int32), dev(b, dtype=torch.int32)
        self.block_table_cpu = torch.zeros(b, self.max_blocks_per_req, dtype=torch.int32, pin_memory=self.pin_memory)
        self.block_table = dev(b, self.max_blocks_per_req, dtype=torch.int32)
        # A step's block table is its first rows' first columns: not contiguous in either
        # table. It goes packed (contiguous, from the front of ``block_table_cpu``) into
        # this staging buffer and is spread into ``block_table`` on the device: copied
        # strided from the host, torch would stage it in pageable memory first.
        self.block_table_staging = dev(b * self.max_blocks_per_req, dtype=torch.int32)
        self.logits_indices_cpu, self.logits_indices = host(b, torch.int64), dev(b, dtype=torch.int64)
        # Input tokens still in flight (``_fill_placeholders``): their places in the input
        # and their rows in the previous step's sampled tensor.
        self.placeholder_index_cpu, self.placeholder_index = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.placeholder_src_cpu, self.placeholder_src = host(n, torch.int64), dev(n, dtype=torch.int64)

        # Async scheduling. The pinned staging buffers above are refilled only after the
        # previous step's copies out of them ran (this event); sampled tokens come back
        # through alternating pinned buffers (two steps can be in flight).
        self._inputs_copied: torch.cuda.Event | None = None
        self._sampled_host = [host(b, torch.int64) for _ in range(2)]
        self._sampled_slot = 0
        # The last step's sampled tokens on the device, and the row in them of each
        # input-batch row's request (-1: none).
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sampled_of_row = np.full(self.max_num_reqs, -1, dtype=np.int64)
        # Requests whose own work failed (id -> why), left out of every step until the
        # scheduler lists them in finished_req_ids.
        self._failed: dict[str, str] = {}
        # A step launched without sampling (``pending_structured_output_tokens``): what
        # ``sample_tokens`` samples, or its already complete output.
        self._unsampled: _UnsampledStep | PendingModelRunnerOutput | None = None
        # The last step's sampling tensors while they hold for the same rows: keyed by the
        # input batch's version and the rows' request ids (``_sample_rows``).
        self._sampling_metadata: tuple[tuple[int, tuple[str, ...]], SamplingMetadata] | None = None

    # ------------------------------------------------------------------ setup
    def load_model(self) -> None:
        """Build the model on the device and load its weights (and LoRA slots when enabled)."""
        self.model = get_model(self.config, self.device)
        # MLAAttention layers hold a latent cache (one KV "head" of kv_lora_rank +
        # qk_rope_head_dim values per token); the cache code below treats both alike.
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, (Attention, MLAAttention))]
        if not self.attn_layers:
            raise RuntimeError(f"model {type(self.model).__name__} has no kvloom Attention layers")
        if self.config.lora.enable_lora:
            self.lora_manager = LoRAManager(self.model, self.config, self.device, self.max_num_tokens)
        if self.config.compilation.compile_model:
            self._set_up_compile()

    def _set_up_compile(self) -> None:
        """``torch.compile`` the model's forward through kvloom's piecewise backend; the
        compile itself happens on the first forward (and once more for a batch of one
        token, which Dynamo specialises)."""
        assert self.model is not None
        comp = self.config.compilation
        names = [layer.prefix for layer in self.attn_layers]
        if len(set(names)) != len(names) or "" in names:
            raise RuntimeError(
                f"torch.compile needs a unique prefix on every Attention layer (the attention op finds its "
                f"layer by it); model {type(self.model).__name__} has {names}"
            )
        self._attn_by_name = dict(zip(names, self.attn_layers))
        use_compile_cache(self.config)
        wrap: Callable[[Any, int, int], CUDAGraphWrapper] | None = None
        if self.dispatcher.piecewise_sizes:
            self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
            pool = self.graph_pool

            def wrap_piece(runnable: Any, index: int, count: int) -> CUDAGraphWrapper:
                return CUDAGraphWrapper(runnable, CUDAGraphMode.PIECEWISE, pool, name=f"piece {index + 1}/{count}")

            wrap = wrap_piece

        # Dynamo keeps at most ``recompile_limit`` (8) compiled versions per code object
        # and runs eagerly past it; each engine built in one process adds one (or two):
        # processes that build many engines (tests) call torch._dynamo.reset() between them.
        self.compile_backend = PiecewiseBackend(comp.splitting_ops, comp.use_inductor, wrap)
        self._compiled_forward = compile_forward(self.model.forward, self.compile_backend)

    def run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> Any:
        """The model's forward (compiled when compilation is on), inside a forward context;
        ``intermediate_tensors``: the previous pipeline stage's (never compiled: pipeline
        parallelism runs eagerly)."""
        assert self.model is not None
        if intermediate_tensors is not None:
            return self.model(input_ids, positions, intermediate_tensors)
        if self._compiled_forward is None:
            return self.model(input_ids, positions)
        assert self.compile_backend is not None
        # One compiled graph for every token count.
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        graphs, start = self.compile_backend.stats.graphs, time.perf_counter()
        hidden = self._compiled_forward(input_ids, positions)
        if self.compile_backend.stats.graphs != graphs:
            elapsed = time.perf_counter() - start
            self.compile_seconds += elapsed
            logger.info("torch.compile for %d tokens: %.1f s (Dynamo + backend; %.1f s in all so far)",
                        input_ids.shape[0], elapsed, self.compile_seconds)  # fmt: skip
        return hidden

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all attention layers (for sizing the cache)."""
        dtype = self.kv_cache_dtype()
        per_layer = [
            int(np.prod(self.backend.get_kv_cache_shape(1, self.block_size, a.num_kv_heads, a.head_size)))
            for a in self.attn_layers
        ]
        return sum(per_layer) * torch.empty((), dtype=dtype).element_size()

    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: ``--kv-cache-dtype``, or the model's for "auto"."""
        name = self.config.cache.cache_dtype
        return self.config.model.dtype if name == "auto" else getattr(torch, name)

    def initialize_kv_cache(self, num_blocks: int, for_profiling: bool = False) -> None:
        """Allocate each layer's KV cache and the backend's metadata builder. A profiling
        run (``for_profiling``) needs only block 0: dummy requests read block-table row 0
        and write nothing."""
        dtype = self.kv_cache_dtype()
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = allocate_kv_cache(shape, dtype, self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        first = self.attn_layers[0]
        spec = AttentionLayerSpec(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=self.config.model.dtype,
            kv_cache_dtype=dtype,
            block_size=self.block_size,
            max_num_seqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            scale=first.scale,
            extra=first.dims.to_extra() if isinstance(first, MLAAttention) else {},
        )
        if isinstance(first, MLAAttention):
            # The core splits each step into decode and prefill requests and asks each
            # phase backend's builder for its part (kvloom.attention.mla_metadata).
            self.builder = MLAMetadataBuilder(
                spec, self.device, self.max_blocks_per_req, first.backend, first.prefill_backend
            )
        else:
            self.builder = self.backend.get_builder_cls()(spec, self.device, self.max_blocks_per_req)
        if for_profiling:
            return
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB, %s) for %d layers",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**30,
            str(dtype).removeprefix("torch."),
            len(self.attn_layers),
        )

    def _release_kv_cache(self) -> None:
        self.kv_caches = []
        self.builder = None
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)

    # ------------------------------------------------------------------ profiling, CUDA graphs
    @torch.inference_mode()
    def profile_peak_memory(self, memory: DeviceMemory) -> int:
        """Torch's peak allocated bytes (``memory.max_memory_allocated()``; pass
        ``torch.cuda`` on CUDA) over one forward at the largest batch the scheduler can
        produce (``max_num_batched_tokens`` tokens over ``max_num_seqs`` requests) plus a
        sampler pass over its logits.

        Runs before the KV cache exists: the forward needs a builder and a cache to read,
        and one block is all dummy requests touch, so a one-block cache serves it and is
        released again; ``initialize_kv_cache`` then allocates the real one."""
        self.initialize_kv_cache(1, for_profiling=True)
        memory.synchronize()
        memory.reset_peak_memory_stats()
        num_reqs = self.max_num_reqs
        logits = self.dummy_forward(self.max_num_tokens, num_reqs)
        if self.pp_last:
            self._dummy_sample(logits, num_reqs)
            self._warm_up_random_sample(logits, num_reqs)
        memory.synchronize()
        peak = memory.max_memory_allocated()
        del logits
        self._release_kv_cache()
        gc.collect()
        memory.empty_cache()
        return peak

    def _dummy_sample(self, logits: torch.Tensor, num_reqs: int) -> None:
        """A sampler pass over ``num_reqs`` rows with the memory-hungry features on
        (temperature, top-p, top-k, logprobs)."""
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * num_reqs
        metadata = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[[0]] * num_reqs,
            output_token_ids=[[]] * num_reqs,
            generators={},
            vocab_size=logits.shape[-1],
            device=logits.device,
            eos_token_ids=[None] * num_reqs,
        )
        self.sampler(logits, metadata)  # it casts to float32 itself, as on every step

    @staticmethod
    def _warm_up_random_sample(logits: torch.Tensor, num_reqs: int) -> None:
        """Run the platform's ``random_sample`` op (the sampler's fast path) once per
        kernel variant a run can meet: with and without greedy rows, at one row and at the
        largest batch (kernels may split the vocabulary by batch size). Its first call per
        variant compiles it (Triton: ~0.5 s), which a step would otherwise pay: measured on
        the H100, the first nano-vllm run after start-up lost 5% to it."""
        op = get_custom_op("random_sample")
        if op is None:
            return
        for rows in sorted({1, num_reqs}):
            temperature = torch.ones(rows, dtype=torch.float32, device=logits.device)
            greedy = torch.zeros(rows, dtype=torch.bool, device=logits.device)
            op(logits[:rows], temperature, None)
            op(logits[:rows], temperature, greedy)

    def capture_cudagraphs(self) -> None:
        """Capture the graphs the dispatcher will ask for: piecewise graphs of the
        compiled model for each piecewise size, then a full graph of a uniform decode
        batch (model forward + LM head) for each full decode size; steps replay them from
        then on. Runs after ``initialize_kv_cache``; does nothing when the resolved mode
        is NONE."""
        d = self.dispatcher
        if not d.piecewise_sizes and not d.full_decode_sizes:
            logger.info(
                "CUDA graphs off (mode %s, backend %s supports %s, compiled: %s)",
                d.mode.value,
                self.backend.NAME,
                self.backend.cudagraph_support.name,
                self._compiled_forward is not None,
            )
            return
        start = time.perf_counter()
        self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
        for desc in d.descriptors(CUDAGraphMode.PIECEWISE):
            self._capture_piecewise(desc)
        if d.piecewise_sizes:
            logger.info("Captured piecewise CUDA graphs for %d token counts (%d..%d) in %.1f s",
                        len(d.piecewise_sizes), d.piecewise_sizes[0], d.piecewise_sizes[-1],
                        time.perf_counter() - start)  # fmt: skip
        if d.full_decode_sizes:
            graphs = CUDAGraphRunner(self, d.full_decode_sizes, self.graph_pool)
            graphs.capture()
            self.cudagraphs = graphs
        d.enabled = True
        logger.info("CUDA graphs (%s) captured in %.1f s", d.mode.value, time.perf_counter() - start)

    @torch.inference_mode()
    def _capture_piecewise(self, desc: BatchDescriptor) -> None:
        """A warm-up forward without graphs at ``desc``'s size (Triton compiles, Dynamo
        settles), then one under PIECEWISE, which makes every piece's wrapper capture."""
        n = desc.num_tokens
        num_reqs = min(n, self.max_num_reqs)
        query_lens = np.full(num_reqs, n // num_reqs, dtype=np.int64)
        query_lens[: n % num_reqs] += 1
        common = self.dummy_metadata(query_lens)
        self.input_ids[:n].zero_()
        self.positions[:n].zero_()
        assert self.builder is not None
        metadata = self.builder.build(common)
        self._forward(n, metadata)
        torch.cuda.synchronize()
        self._forward(n, metadata, runtime_mode=CUDAGraphMode.PIECEWISE, descriptor=desc)
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ state updates
    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed % (2**63))
        return gen

    def _request_work(self, req_id: str, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, work that belongs to request ``req_id`` alone. If it raises, the
        request fails (``self._failed``, logged with the traceback) and None is returned;
        the caller leaves the request out and goes on with the others."""
        try:
            return fn(*args)
        except Exception as exc:
            logger.exception("Request %s failed in the model runner (%s)", req_id, what)
            self._failed[req_id] = f"{what} failed ({type(exc).__name__}: {exc})"
            return None

    def _add_request_state(self, new: Any) -> bool:
        params = new.sampling_params
        self.input_batch.add(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=new.output_token_ids,
            sampling_params=params,
            pooling_params=new.pooling_params,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            lora_request=new.lora_request,
            generator=self._make_generator(params.seed if params is not None else None),
            eos_token_id=new.eos_token_id,
        )
        return True

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.input_batch.remove(req_id)
            self._failed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.input_batch.remove(new.req_id)  # a resumed request replaces its old state
            if new.req_id not in self._failed:
                self._request_work(new.req_id, "setting up its state", self._add_request_state, new)
        for cached in so.scheduled_cached_reqs:
            if cached.req_id in self._failed:
                continue
            state = self.input_batch[cached.req_id]
            self.input_batch.append_blocks(state, cached.new_block_ids)
            if cached.new_token_ids is not None and not self.pp_last:
                # Pipeline parallelism: the last stage sampled these; this stage learns them here.
                self.input_batch.write_tokens(state, cached.num_computed_tokens, cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        if self.lora_manager is not None:
            for req_id in so.num_scheduled_tokens:
                state = self.input_batch.requests.get(req_id)
                if state is not None and state.lora_request is not None and req_id not in self._failed:
                    self._request_work(req_id, f"loading its LoRA adapter {state.lora_request.lora_name!r}",
                                       self.lora_manager.ensure_loaded, state.lora_request)  # fmt: skip

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]) -> tuple[StepBatch, CommonAttentionMetadata]:
        """The step's inputs for ``req_ids`` (the scheduled requests that have not failed)."""
        if self._inputs_copied is not None:  # the previous step's host->device copies
            self._inputs_copied.synchronize()
            self._inputs_copied = None
        requests = self.input_batch.requests
        states = [requests[r] for r in req_ids]
        b = len(req_ids)
        scheduled = so.num_scheduled_tokens
        # req_ids is the scheduler's order less the failed requests: with none left out,
        # the token counts are the dict's values as they stand.
        counts = scheduled.values() if b == len(scheduled) else (scheduled[r] for r in req_ids)
        query_lens = np.fromiter(counts, dtype=np.int64, count=b)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=b)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=b)
        seq_lens = starts + query_lens
        n = int(query_lens.sum())
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])

        # positions: for each token, its request's start + its index within the request
        token_rows = np.repeat(rows, query_lens)
        positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(n)
        self.positions_cpu.numpy()[:n] = positions
        input_ids = self.input_batch.token_ids[token_rows, positions]
        self.input_ids_cpu.numpy()[:n] = input_ids
        blocks = self.input_batch.block_table[token_rows, positions // self.block_size]
        self.slot_mapping_cpu.numpy()[:n] = blocks.astype(np.int64) * self.block_size + positions % self.block_size
        self.query_start_loc_cpu.numpy()[: b + 1] = cu
        self.seq_lens_cpu.numpy()[:b] = seq_lens
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        packed = self.block_table_cpu.view(-1)[: b * max_blocks].view(b, max_blocks)
        packed.numpy()[:] = self.input_batch.block_table[rows, :max_blocks]
        logits_indices = cu[1:] - 1
        self.logits_indices_cpu.numpy()[:b] = logits_indices

        # One host->device copy per buffer (asynchronous from pinned memory on CUDA).
        nb = self.pin_memory
        self.input_ids[:n].copy_(self.input_ids_cpu[:n], non_blocking=nb)
        self.positions[:n].copy_(self.positions_cpu[:n], non_blocking=nb)
        self.slot_mapping[:n].copy_(self.slot_mapping_cpu[:n], non_blocking=nb)
        self.query_start_loc[: b + 1].copy_(self.query_start_loc_cpu[: b + 1], non_blocking=nb)
        self.seq_lens[:b].copy_(self.seq_lens_cpu[:b], non_blocking=nb)
        staged = self.block_table_staging[: b * max_blocks].view(b, max_blocks)
        staged.copy_(packed, non_blocking=nb)
        self.block_table[:b, :max_blocks].copy_(staged)
        self.logits_indices[:b].copy_(self.logits_indices_cpu[:b], non_blocking=nb)
        if (placeholders := np.flatnonzero(input_ids < 0)).size:
            self._fill_placeholders(placeholders, np.repeat(np.arange(b), query_lens), req_ids, rows)

        max_query_len = int(query_lens.max())
        common = self.common_metadata(b, n, max_query_len, int(seq_lens.max()))
        batch = StepBatch(
            req_ids=req_ids,
            states=states,
            num_tokens=n,
            query_lens=query_lens,
            seq_lens=seq_lens,
            logits_indices=logits_indices,
            uniform_decode=max_query_len == 1,
            rows=rows,
            any_prompt_logprobs=self.input_batch.num_prompt_logprobs > 0,
        )
        return batch, common

    def _fill_placeholders(
        self, token_index: np.ndarray, req_of_token: np.ndarray, req_ids: list[str], rows: np.ndarray
    ) -> None:
        """Input tokens sampled by the step still in flight: copy them on the device.
        ``token_index``: their places in the input; ``req_of_token``: each input token's
        request (an index into ``req_ids`` and their input-batch ``rows``).

        The indices go through the pinned staging buffers like the other inputs: a
        blocking host->device copy (``torch.tensor(..., device=...)``) would wait for the
        whole stream, i.e. for the step in flight, and undo async scheduling's overlap."""
        req_index = req_of_token[token_index]
        src = self._prev_sampled_of_row[rows[req_index]]
        if (missing := np.flatnonzero(src < 0)).size:
            req_id = req_ids[int(req_index[missing[0]])]
            raise RuntimeError(f"request {req_id} has an input token that no step in flight samples")
        assert self._prev_sampled is not None
        k, nb = len(src), self.pin_memory
        self.placeholder_index_cpu.numpy()[:k] = token_index
        self.placeholder_src_cpu.numpy()[:k] = src
        dst = self.placeholder_index[:k]
        dst.copy_(self.placeholder_index_cpu[:k], non_blocking=nb)
        self.placeholder_src[:k].copy_(self.placeholder_src_cpu[:k], non_blocking=nb)
        self.input_ids[dst] = self._prev_sampled[self.placeholder_src[:k]]

    # ------------------------------------------------------------------ forward
    def _forward_eager(self, n: int, common: CommonAttentionMetadata) -> torch.Tensor | None:
        assert self.builder is not None
        return self._forward(n, self.builder.build(common))

    def _forward(
        self,
        n: int,
        attn_metadata: Any,
        extras: dict[str, Any] | None = None,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
        descriptor: BatchDescriptor | None = None,
    ) -> torch.Tensor | None:
        """The forward over the first ``n`` tokens of the input buffers; under PIECEWISE
        over ``descriptor.num_tokens`` (the rows past ``n`` are zero padding, which
        attention skips), returning the ``n`` real rows. On a pipeline stage other than
        the first it receives the previous stage's tensors first; on one other than the
        last it sends its own to the next stage and returns None."""
        padded = descriptor.num_tokens if descriptor is not None else n
        if padded > n:
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
        intermediate = None
        if not self.pp_first:
            hidden_size = self.config.model.hf_config.hidden_size
            packed = torch.empty(2, n, hidden_size, dtype=self.config.model.dtype, device=self.device)
            intermediate = IntermediateTensors.unpack(parallel_state.recv_from_previous_stage(packed))
        if not self.pp_last:
            with set_forward_context(attn_metadata, attn_layers=self._attn_by_name, num_actual_tokens=n,
                                     **(extras or {})):  # fmt: skip
                out = self.run_model(self.input_ids[:n], self.positions[:n], intermediate)
            self._send_to_next_stage(out.pack())
            return None
        with set_forward_context(
            attn_metadata,
            attn_layers=self._attn_by_name,
            num_actual_tokens=n,
            cudagraph_runtime_mode=runtime_mode,
            batch_descriptor=descriptor,
            **(extras or {}),
        ):
            return self.run_model(self.input_ids[:padded], self.positions[:padded], intermediate)[:n]

    def _send_to_next_stage(self, packed: torch.Tensor) -> None:
        """Start sending ``packed`` to the next stage without waiting for it to arrive (the
        next stage may still be busy with the previous micro-batch): this stage goes on
        with its next step. The previous send is finished first, so at most one is open."""
        if self._pp_send is not None:
            self._pp_send[0].wait()
        self._pp_send = (parallel_state.send_to_next_stage(packed), packed)

    def _mark_inputs_copied(self) -> None:
        """Record, behind the step's host->device copies and before its forward, the event
        the next step waits for before it rewrites the pinned staging buffers. Recorded
        after the forward instead, it would make the next step's input preparation wait
        for this whole step on the device, undoing async scheduling's overlap."""
        if self.pin_memory:
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step and return its results; None for a step whose sampling waits for
        ``sample_tokens`` (``so.pending_structured_output_tokens``)."""
        pending = self.execute_model_async(so)
        return None if pending is None else pending.get_output()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step; its results are on the host once ``get_output()`` returns.

        A step with ``pending_structured_output_tokens`` (async scheduling: the bitmask of
        its structured requests follows tokens of the step before it, still in flight) runs
        its forward only and returns None; the logits stay on the device until
        ``sample_tokens`` masks them with the bitmask and samples."""
        if self._unsampled is not None:
            raise RuntimeError("a step was launched while the previous one still waits for sample_tokens()")
        step = self._launch(so)
        if so.pending_structured_output_tokens:
            self._unsampled = step
            return None
        if isinstance(step, _UnsampledStep):
            return self._sample_step(step, so.structured_output_request_ids, so.grammar_bitmask)
        return step

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Sample the step ``execute_model_async`` launched without sampling, its
        structured requests' logits masked with ``grammar`` (None: no row, every structured
        request of the step finished meanwhile)."""
        step, self._unsampled = self._unsampled, None
        if step is None:
            raise RuntimeError("sample_tokens() without a step launched with pending_structured_output_tokens")
        if not isinstance(step, _UnsampledStep):  # no logits (every request failed): already complete
            return step
        if grammar is None:
            return self._sample_step(step, {}, None)
        return self._sample_step(step, grammar.structured_output_request_ids, grammar.grammar_bitmask)

    def _sample_step(
        self, step: _UnsampledStep, rows: dict[str, int], bitmask: torch.Tensor | None
    ) -> AsyncModelRunnerOutput:
        if bitmask is not None and step.logits is not None:
            # Masked in float32, the dtype every grammar kernel takes (the LM head gives the
            # model dtype); only steps with structured requests pay for the copy.
            step.logits = step.logits.float()
            apply_grammar_bitmask(step.logits, step.batch.req_ids, rows, bitmask)
        return self._postprocess(step.batch, step.logits, step.hidden)

    def _launch(self, so: SchedulerOutput) -> _UnsampledStep | PendingModelRunnerOutput:
        """The step's forward up to the logits; a complete output where nothing samples."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return PendingModelRunnerOutput.done(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        failed = self._failed
        req_ids = [r for r in so.num_scheduled_tokens if r not in failed] if failed else list(so.num_scheduled_tokens)
        if not req_ids:  # every scheduled request has failed
            self._prev_sampled = None
            self._prev_sampled_of_row.fill(-1)
            ids = list(so.num_scheduled_tokens)
            return PendingModelRunnerOutput.done(ModelRunnerOutput(
                req_ids=ids, sampled_token_ids=[[] for _ in ids], failed={r: failed[r] for r in ids}))  # fmt: skip
        batch, common = self._prepare_inputs(so, req_ids)
        batch.failed_req_ids = [r for r in so.num_scheduled_tokens if r in failed] if failed else []
        b = len(batch.req_ids)
        if not self.pp_last:
            # An earlier pipeline stage: forward its layers, hand the stream on; the last
            # stage samples and its output is the step's.
            assert self.builder is not None
            self._forward(batch.num_tokens, self.builder.build(common), self._lora_extras(batch))
            return PendingModelRunnerOutput.done(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))

        logits = None
        hidden = None
        # LoRA steps run without graphs: the captured graphs hold no adapter updates.
        mode, descriptor = CUDAGraphMode.NONE, None
        if self.lora_manager is None:
            mode, descriptor = self.dispatcher.dispatch(batch.num_tokens, batch.uniform_decode)
        if mode == CUDAGraphMode.FULL:
            assert self.cudagraphs is not None and descriptor is not None
            size = self.cudagraphs.prepare(b, descriptor.num_tokens)
            self._mark_inputs_copied()
            logits = self.cudagraphs.replay(size, b)
        else:
            assert self.builder is not None
            attn_metadata = self.builder.build(common)
            self._mark_inputs_copied()
            hidden = self._forward(batch.num_tokens, attn_metadata, self._lora_extras(batch), mode, descriptor)
            if mode == CUDAGraphMode.PIECEWISE and any(
                s.pooling_params is not None
                or (s.sampling_params is not None and s.sampling_params.prompt_logprobs is not None)
                for s in batch.states
            ):
                # A replayed graph's output is overwritten by the next step, which async
                # scheduling launches before this step's prompt logprobs / pooling run.
                hidden = hidden.clone()
        if logits is None and self.config.model.runner != "pooling":  # embedding models have no LM head
            assert hidden is not None and self.model is not None
            logits = self.model.compute_logits(hidden[self.logits_indices[:b]])
        return _UnsampledStep(batch, logits, hidden)

    def _lora_extras(self, batch: StepBatch) -> dict[str, Any]:
        """The forward-context extras of a step: each token's LoRA adapter slot."""
        if self.lora_manager is None:
            return {}
        return self.lora_manager.forward_extras([s.lora_request for s in batch.states], batch.query_lens)

    # ------------------------------------------------------------------ sampling
    def _postprocess(
        self, batch: StepBatch, logits: torch.Tensor | None, hidden: torch.Tensor | None
    ) -> AsyncModelRunnerOutput:
        """Sample on the device, start copying the tokens to the host, and return what
        waits for them. Until then each sampling request holds a placeholder token."""

        states = batch.states
        # A request still prefilling its prompt produces no token this step.
        done_prefill = [seq_len >= s.num_tokens for seq_len, s in zip(batch.seq_lens.tolist(), states)]
        gen_idx = [i for i, s in enumerate(states) if s.sampling_params is not None]
        tokens: InFlightTokens | None = None
        self._prev_sampled = None
        self._prev_sampled_of_row.fill(-1)

        if gen_idx:
            assert logits is not None
            out, gen_idx = self._sample(logits, states, gen_idx)
        if gen_idx:
            sampled = out.sampled_token_ids
            sampled_host = self._sampled_host[self._sampled_slot][: len(gen_idx)]
            self._sampled_slot ^= 1
            sampled_host.copy_(sampled, non_blocking=self.pin_memory)
            copied: torch.cuda.Event | None = None
            if self.pin_memory:
                copied = torch.cuda.Event()
                copied.record()
            # The requests that produce a token (prefill done): their rows in ``sampled``
            # and in the batch; each holds a placeholder until the token is on the host.
            sample_rows = [j for j, i in enumerate(gen_idx) if done_prefill[i]]
            batch_index = [gen_idx[j] for j in sample_rows]
            placeholders = self.input_batch.append_placeholders([states[i] for i in batch_index])
            self._prev_sampled = sampled
            self._prev_sampled_of_row[placeholders.rows] = sample_rows
            tokens = InFlightTokens(out, sampled_host, copied, batch_index, sample_rows, placeholders)

        return AsyncModelRunnerOutput(
            self, batch, hidden, done_prefill, tokens, has_pooling=any(s.pooling_params is not None for s in states)
        )

    def _sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], gen_idx: list[int]
    ) -> tuple[SamplerOutput, list[int]]:
        """Sample the rows ``gen_idx`` of ``logits``; returns the sampler's output and the
        rows it covers. If the batch fails, each row is sampled alone to find the requests
        at fault; they fail, and the others are sampled again (with the same noise: a
        seeded row's generator is re-seeded for the step). A failure that no single row
        reproduces is the step's own and propagates."""
        try:
            return self._sample_rows(logits, states, gen_idx), gen_idx
        except Exception:
            at_fault = [i for i in gen_idx if self._request_work(states[i].req_id, "sampling",
                                                                   self._sample_rows, logits, states, [i]) is None]  # fmt: skip
            if not at_fault:
                raise
            logger.warning("Sampling failed for requests %s; sampling the rest of the batch again",
                           [states[i].req_id for i in at_fault])  # fmt: skip
            kept = [i for i in gen_idx if i not in at_fault]
            if not kept:
                return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device), None, []), []
            return self._sample_rows(logits, states, kept), kept

    def _sample_rows(self, logits: torch.Tensor, states: list[CachedRequestState], rows: list[int]) -> SamplerOutput:
        gen_states = [states[i] for i in rows]
        for s in gen_states:
            if s.generator is not None:
                # The noise for output token k depends only on (seed, k): seeded requests
                # give the same tokens whatever the batch and across preemptions.
                s.generator.manual_seed(_step_seed(s.sampling_params.seed, len(s.output_token_ids)))  # type: ignore[union-attr,arg-type]
        # The same requests in the same rows as the step before (a decode batch without
        # arrivals or departures) sample with the same tensors, unless they count tokens.
        key = (self.input_batch.version, tuple([s.req_id for s in gen_states]))
        if self._sampling_metadata is not None and self._sampling_metadata[0] == key:
            metadata = self._sampling_metadata[1]
        else:
            metadata = SamplingMetadata.build(
                params=[s.sampling_params for s in gen_states],  # type: ignore[misc]
                prompt_token_ids=[s.prompt_token_ids for s in gen_states],
                output_token_ids=[s.output_token_ids for s in gen_states],
                generators={j: s.generator for j, s in enumerate(gen_states) if s.generator is not None},
                vocab_size=logits.shape[-1],
                device=logits.device,
                eos_token_ids=[s.eos_token_id for s in gen_states],
            )
            self._sampling_metadata = (key, metadata) if metadata.reusable else None
        gen_logits = logits if len(rows) == len(states) else logits[torch.as_tensor(rows, device=logits.device)]
        # In the LM head's dtype: the sampler casts to float32 itself, except on its
        # random_sample fast path, which reads the logits as they are.
        return self.sampler(gen_logits, metadata)

    def _prompt_logprobs(
        self, batch: StepBatch, hidden: torch.Tensor | None, out: dict[str, list[TokenLogprobs]]
    ) -> None:
        """Logprobs of prompt tokens 1..P-1 computed in this step's chunk."""

        assert self.model is not None
        start_of = np.zeros(len(batch.states) + 1, dtype=np.int64)
        np.cumsum(batch.query_lens, out=start_of[1:])
        for i, s in enumerate(batch.states):
            params = s.sampling_params
            if params is None or params.prompt_logprobs is None or hidden is None or s.req_id in self._failed:
                continue
            first_pos = int(batch.seq_lens[i] - batch.query_lens[i])
            # token at position p predicts prompt token p+1; only prompt targets count
            last_pos = min(int(batch.seq_lens[i]), s.num_prompt_tokens - 1)
            if last_pos <= first_pos:
                continue
            result = self._request_work(s.req_id, "computing its prompt logprobs", self._prompt_logprobs_of,
                                        s, hidden, int(start_of[i]), first_pos, last_pos)  # fmt: skip
            if result is not None:
                out[s.req_id] = result

    def _prompt_logprobs_of(
        self, s: CachedRequestState, hidden: torch.Tensor, start: int, first_pos: int, last_pos: int
    ) -> list[TokenLogprobs]:
        assert self.model is not None and s.sampling_params is not None
        idx = torch.arange(start, start + (last_pos - first_pos), device=hidden.device)
        targets = torch.as_tensor(s.prompt_token_ids[first_pos + 1 : last_pos + 1], device=hidden.device)
        logits = self.model.compute_logits(hidden[idx]).float()
        return compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)  # type: ignore[arg-type]

    def _pool(
        self, batch: StepBatch, hidden: torch.Tensor | None, done_prefill: list[bool]
    ) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(batch.states)
        if hidden is None:
            return results
        start = 0
        for i, s in enumerate(batch.states):
            n = int(batch.query_lens[i])
            if s.pooling_params is not None and s.req_id not in self._failed:
                chunk = hidden[start : start + n]
                results[i] = self._request_work(s.req_id, "pooling", pool_request, self.config, s, chunk,
                                                done_prefill[i])  # fmt: skip
            start += n
        return results

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int, num_reqs: int | None = None) -> torch.Tensor:
        """A forward over ``num_tokens`` tokens spread over ``num_reqs`` requests, with
        every KV write disabled (slot -1), for memory profiling and warm-up."""
        num_reqs = min(num_reqs or 1, num_tokens, self.max_num_reqs)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        query_lens[: num_tokens % num_reqs] += 1
        common = self.dummy_metadata(query_lens)
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].copy_(torch.arange(num_tokens, device=self.device) % self.max_model_len)
        hidden = self._forward_eager(num_tokens, common)
        assert self.model is not None
        if hidden is None:  # a pipeline stage before the last: no logits here
            return torch.empty(0, device=self.device)
        if self.config.model.runner == "pooling":  # embedding models have no LM head
            return hidden[self.logits_indices[:num_reqs]]
        return self.model.compute_logits(hidden[self.logits_indices[:num_reqs]])

    def dummy_metadata(self, query_lens: np.ndarray) -> CommonAttentionMetadata:
        """Metadata for padding/warm-up requests: block-table rows 0, no KV writes."""
        b = len(query_lens)
        n = int(query_lens.sum())
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        self.query_start_loc_cpu.numpy()[: b + 1] = cu
        self.seq_lens_cpu.numpy()[:b] = query_lens
        self.logits_indices_cpu.numpy()[:b] = cu[1:] - 1
        self.query_start_loc[: b + 1].copy_(self.query_start_loc_cpu[: b + 1])
        self.seq_lens[:b].copy_(self.seq_lens_cpu[:b])
        self.logits_indices[:b].copy_(self.logits_indices_cpu[:b])
        self.block_table[:b].zero_()
        self.slot_mapping[:n].fill_(-1)
        return self.common_metadata(b, n, int(query_lens.max()), int(query_lens.max()))

    def common_metadata(self, b: int, n: int, max_query_len: int, max_seq_len: int) -> CommonAttentionMetadata:
        """The step's metadata as views of the persistent buffers (first ``b`` requests,
        ``n`` tokens), which the caller has filled."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:n],
            num_reqs=b,
            num_actual_tokens=n,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=self.query_start_loc_cpu[: b + 1],
            seq_lens_cpu=self.seq_lens_cpu[:b],
        )


@dataclass
class _UnsampledStep:
    """A step whose forward ran (on the device, maybe still running) and whose logits wait
    to be masked and sampled (``ModelRunner.sample_tokens``)."""

    batch: StepBatch
    logits: torch.Tensor | None
    hidden: torch.Tensor | None


@dataclass
class InFlightTokens:
    """The tokens one step sampled, on their way to the host."""

    sampler_output: SamplerOutput
    #: Pinned host rows the tokens are copied into (row j: the step's j-th sampling request).
    host: torch.Tensor
    #: Recorded behind the copy on CUDA; None where the copy is synchronous.
    copied: torch.cuda.Event | None
    #: Per request that produced a token: its index in the batch, its row in ``host``,
    #: and its placeholder.
    batch_index: list[int]
    sample_rows: list[int]
    placeholders: Placeholders


class AsyncModelRunnerOutput(PendingModelRunnerOutput):
    """A launched step (``ModelRunner.execute_model_async``) whose sampled tokens may
    still be on their way to the host.

    ``get_output()`` waits for the copy, writes each token over its request's placeholder
    in the runner's input batch (unless the request left the batch meanwhile), and adds
    the prompt logprobs and pooled outputs of the step, computed then from its hidden
    states. It runs once; later calls return the same output.
    """

    def __init__(
        self,
        runner: ModelRunner,
        batch: StepBatch,
        hidden: torch.Tensor | None,
        done_prefill: list[bool],
        tokens: InFlightTokens | None,
        has_pooling: bool,
    ) -> None:
        self._runner = runner
        self._batch = batch
        self._hidden = hidden
        self._done_prefill = done_prefill
        self._tokens = tokens
        self._has_pooling = has_pooling
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._finish()
            self._hidden = self._tokens = None  # the step's device tensors are no longer needed
        return self._output

    @torch.inference_mode()
    def _finish(self) -> ModelRunnerOutput:
        runner, batch, hidden, tokens = self._runner, self._batch, self._hidden, self._tokens
        states = batch.states
        sampled_lists: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(states)
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        pooler_output: list[torch.Tensor | None] | None = None
        if tokens is not None:
            if tokens.copied is not None:
                tokens.copied.synchronize()
            host = tokens.host.tolist()
            # The rows of ``host`` that produced a token: all of them, or a subset in order.
            token_ids = host if len(tokens.sample_rows) == len(host) else [host[j] for j in tokens.sample_rows]
            runner.input_batch.set_tokens(tokens.placeholders, token_ids)
            if len(tokens.batch_index) == len(states):  # every request produced one (a decode step)
                sampled_lists = [[token_id] for token_id in token_ids]
            else:
                for i, token_id in zip(tokens.batch_index, token_ids):
                    sampled_lists[i] = [token_id]
            row_logprobs = tokens.sampler_output.logprobs_lists()
            if row_logprobs is not None:
                for i, j in zip(tokens.batch_index, tokens.sample_rows):
                    logprobs[i] = row_logprobs[j]
            if batch.any_prompt_logprobs:
                runner._prompt_logprobs(batch, hidden, prompt_logprobs)
        if self._has_pooling:
            pooler_output = runner._pool(batch, hidden, self._done_prefill)
        # Requests whose own work failed (before the step or in it) report no result.
        failed: dict[str, str] = {}
        if runner._failed:
            failed = {r: runner._failed[r] for r in [*batch.req_ids, *batch.failed_req_ids] if r in runner._failed}
        req_ids = batch.req_ids
        if batch.failed_req_ids:
            req_ids = [*req_ids, *batch.failed_req_ids]
            sampled_lists += [[] for _ in batch.failed_req_ids]
            logprobs += [None] * len(batch.failed_req_ids)
            if pooler_output is not None:
                pooler_output += [None] * len(batch.failed_req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=prompt_logprobs,
            pooler_output=pooler_output,
            failed=failed,
        )
