"""The model runner: the driver of one device's step over named parts.

STYLE RULE (as vLLM's model runner V2 states it): this file holds only what every model
needs. A new feature goes into a part of its own beside it, which the driver calls; be
paranoid about adding lines here, and prefer functions defined elsewhere.

The parts:

- ``StepInputs`` (``step_inputs.py``): the persistent host/device buffers and their
  filling per step, the async placeholders;
- ``StepSampler`` (``step_sampler.py``): seeded generators, per-row isolation and retry,
  warm-ups;
- ``StepOutputs`` (``step_output.py``): sampled tokens on their way to the host, prompt
  logprobs, pooling, the ``ModelRunnerOutput``;
- ``RequestFailures`` (``request_failures.py``): work that fails one request alone;
- ``KVCacheMemory`` (``kv_cache_memory.py``): bytes per block, allocation, the builder;
- ``WorkerConnector`` (``kv_connector.py``): the KV connector's worker side around each
  step and, through the forward context, each attention layer;
- ``CUDAGraphRunner`` (``cudagraph.py``) and ``CudagraphDispatcher``: full decode graphs
  and which graph a step replays; ``InputBatch``: the running requests' rows.

A step (``execute_model``): apply the scheduler's differences to the input batch, fill
the inputs, build the backend's metadata, run the model (replaying a CUDA graph when the
dispatcher says so), compute last-token logits, sample, and start copying the tokens to
the host. It returns before they arrive (async scheduling): ``get_output()`` of the
returned ``PendingModelRunnerOutput`` waits. A step whose structured requests' bitmask
waits for tokens still in flight (``pending_structured_output_tokens``) stops after the
logits; ``sample_tokens`` masks and samples them once the engine core has the bitmask.

Platforms call only the methods of ``kvloom.interfaces.ModelRunnerProtocol``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.compilation.backend import PiecewiseBackend, compile_forward
from kvloom.compilation.cache import use_compile_cache
from kvloom.compilation.cuda_graph import CUDAGraphWrapper
from kvloom.config import EngineConfig
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.distributed import parallel_state
from kvloom.distributed.pipeline import IntermediateTensors
from kvloom.forward_context import BatchDescriptor, set_forward_context
from kvloom.kv_cache.spec import engine_kv_cache_config
from kvloom.loader.model_loader import get_model, load_draft_model
from kvloom.lora.manager import LoRAManager
from kvloom.lora.request import LoRARequest
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.platforms.worker import DeviceMemory
from kvloom.scheduler.output import GrammarOutput, SchedulerOutput
from kvloom.structured_output.bitmask import apply_grammar_bitmask
from kvloom.utils import cdiv
from kvloom.worker.cudagraph import CUDAGraphRunner
from kvloom.worker.cudagraph_dispatcher import CudagraphDispatcher, resolve_cudagraph_mode
from kvloom.worker.input_batch import InputBatch
from kvloom.worker.kv_cache_memory import KVCacheMemory, measure_peak_memory
from kvloom.worker.kv_connector import WorkerConnector
from kvloom.worker.request_failures import RequestFailures
from kvloom.worker.speculation import StepSpeculation
from kvloom.worker.step_inputs import StepBatch, StepInputs
from kvloom.worker.step_output import StepOutputs, UnsampledStep
from kvloom.worker.step_sampler import StepSampler

logger = logging.getLogger(__name__)


def _empty_step(req_ids: list[str] | None = None, failed: dict[str, str] | None = None) -> PendingModelRunnerOutput:
    ids = req_ids or []
    return PendingModelRunnerOutput.done(
        ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[] for _ in ids], failed=failed or {})
    )


class ModelRunner:
    """One device's model, KV cache and step (see the module docstring)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.backend = config.attention.backend
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_model_len = config.model.max_model_len
        self.max_num_tokens = max(config.scheduler.max_num_batched_tokens, self.max_num_reqs)
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        # Pipeline parallelism: the first stage embeds the tokens, the last samples; the
        # others receive and send IntermediateTensors (kvloom.distributed.pipeline).
        self.pp_first, self.pp_last = parallel_state.is_first_stage(), parallel_state.is_last_stage()
        self._pp_send: tuple[Any, torch.Tensor] | None = None  # the send in progress and its buffer
        # Set by load_model / initialize_kv_cache / capture_cudagraphs.
        self.model: nn.Module | None = None
        self.attn_layers: list[Attention | MLAAttention] = []
        self.kv_memory: KVCacheMemory | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.builder: Any = None
        self.lora_manager: LoRAManager | None = None
        self.cudagraphs: CUDAGraphRunner | None = None

        self.failures = RequestFailures()
        # A block table per KV-cache group (kvloom.worker.kv_cache_groups).
        num_groups = engine_kv_cache_config(config).num_groups
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, num_groups)
        # A decode step has 1 token per request, 1 + k with speculative decoding.
        self.uniform_query_len = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
        self.inputs = StepInputs(self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req,
                                 self.block_size, device, num_groups, self.uniform_query_len)  # fmt: skip
        self.sampler = StepSampler(device, config.model.vocab_size, self.input_batch, self.failures)
        self.outputs = StepOutputs(config, device, self.input_batch, self.failures, self.compute_logits)
        self.spec = StepSpeculation(config, device, self.input_batch, self.sampler, self.outputs, self.failures) \
            if config.speculative is not None else None  # fmt: skip
        self.kv_transfer = WorkerConnector(config, self.failures)
        self._init_compilation()
        # A step launched without sampling (``pending_structured_output_tokens``): what
        # ``sample_tokens`` samples, or its already complete output.
        self._unsampled: UnsampledStep | PendingModelRunnerOutput | None = None

    def _init_compilation(self) -> None:
        """torch.compile (set up by ``load_model`` when ``compile_model`` is on) and CUDA
        graphs: the dispatcher decides each step's runtime mode and key; all graphs share
        one memory pool (kvloom.compilation.cuda_graph explains why that is safe)."""
        self.compile_backend: PiecewiseBackend | None = None
        self._compiled_forward: Any = None
        self._attn_by_name: dict[str, Attention] | None = None
        self.compile_seconds = 0.0
        comp = self.config.compilation
        mode, _ = resolve_cudagraph_mode(
            comp.cudagraph_mode,
            self.backend.cudagraph_support,
            comp.compile_model,
            self.config.device.platform.supports_cuda_graphs and self.device.type == "cuda",
            self.uniform_query_len,
        )
        self.dispatcher = CudagraphDispatcher(mode, comp.cudagraph_capture_sizes, self.max_num_reqs,
                                              self.max_num_tokens, self.uniform_query_len)  # fmt: skip
        self.graph_pool: Any = None

    # ------------------------------------------------------------------ model
    def load_model(self) -> None:
        """Build the model on the device and load its weights (and LoRA slots when enabled)."""
        self.model = get_model(self.config, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, (Attention, MLAAttention))]
        if not self.attn_layers:
            raise RuntimeError(f"model {type(self.model).__name__} has no kvloom Attention layers")
        if self.spec is not None:  # a draft model's layers: their KV lives in the same blocks
            self.attn_layers += self.spec.load(self.model, functools.partial(load_draft_model, self.config, self.device))
        self.kv_memory = KVCacheMemory(self.config, self.device, self.attn_layers)
        self.outputs.classify = getattr(self.model, "classify", None)  # a classification model's head
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ KV cache
    def _kv(self) -> KVCacheMemory:
        if self.kv_memory is None:
            raise RuntimeError("load_model() must run before the KV cache is sized or allocated")
        return self.kv_memory

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all attention layers (for sizing the cache)."""
        return self._kv().bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's KV cache and the backend's metadata builder."""
        kv = self._kv()
        self.kv_caches = kv.allocate(num_blocks)
        self.builder = kv.make_builder(self.max_blocks_per_req, self.inputs.group_metadata)
        if self.spec is not None:
            self.spec.bind_kv_cache(functools.partial(kv.make_draft_builder, self.max_blocks_per_req))
        kv.log_size(num_blocks)
        self.kv_transfer.register(self.attn_layers, self.kv_caches)

    @torch.inference_mode()
    def profile_peak_memory(self, memory: DeviceMemory) -> int:
        """Torch's peak allocated bytes (``memory.max_memory_allocated()``; pass
        ``torch.cuda`` on CUDA) over one forward at the largest batch the scheduler can
        produce (``max_num_batched_tokens`` tokens over ``max_num_seqs`` requests) plus a
        sampler pass over its logits.

        Runs before the KV cache exists: dummy requests read block-table row 0 and write
        nothing, so a one-block cache serves the forward and is released again;
        ``initialize_kv_cache`` then allocates the real one."""
        kv = self._kv()

        def run() -> None:
            self.kv_caches = kv.allocate(1)
            self.builder = kv.make_builder(self.max_blocks_per_req, self.inputs.group_metadata)
            # With speculation every verified position has logits: 1 + k rows per request.
            logits = self.dummy_forward(self.max_num_tokens, self.max_num_reqs, self.uniform_query_len)
            if self.pp_last:
                self.sampler.warm_up(logits[: self.max_num_reqs], self.max_num_reqs)
            if self.spec is not None:
                self.spec.profile_run(functools.partial(kv.make_draft_builder, self.max_blocks_per_req), self.max_num_tokens,
                                      self.max_num_reqs)  # fmt: skip
            self.kv_caches, self.builder = [], None
            kv.release()

        return measure_peak_memory(memory, run)

    # ------------------------------------------------------------------ CUDA graphs
    def capture_cudagraphs(self) -> None:
        """Capture the graphs the dispatcher will ask for: piecewise graphs of the
        compiled model for each piecewise size, then a full graph of a uniform decode
        batch (model forward + LM head) for each full decode size; steps replay them from
        then on. Runs after ``initialize_kv_cache``; does nothing when the resolved mode
        is NONE."""
        d = self.dispatcher
        if not d.piecewise_sizes and not d.full_decode_sizes:
            logger.info("CUDA graphs off (mode %s, backend %s supports %s, compiled: %s)", d.mode.value,
                        self.backend.NAME, self.backend.cudagraph_support.name, self._compiled_forward is not None)  # fmt: skip
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
            self.cudagraphs = CUDAGraphRunner(self.inputs, self._run_full_decode, d.full_decode_sizes, self.graph_pool)
            self.cudagraphs.capture(self.builder)
        d.enabled = True
        logger.info("CUDA graphs (%s) captured in %.1f s", d.mode.value, time.perf_counter() - start)

    def _run_full_decode(self, size: int, attn_metadata: Any) -> torch.Tensor:
        """Model + LM head over a decode batch of ``size`` (what a full graph records);
        piecewise wrappers inside the compiled model run their pieces directly."""
        inputs = self.inputs
        with set_forward_context(attn_metadata, attn_layers=self._attn_by_name, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                                 batch_descriptor=BatchDescriptor(size, True)):  # fmt: skip
            return self.compute_logits(self.run_model(inputs.input_ids[:size], inputs.positions[:size]))

    @torch.inference_mode()
    def _capture_piecewise(self, desc: BatchDescriptor) -> None:
        """A warm-up forward without graphs at ``desc``'s size (Triton compiles, Dynamo
        settles), then one under PIECEWISE, which makes every piece's wrapper capture."""
        n = desc.num_tokens
        metadata = self.builder.build(self.inputs.dummy_metadata(_spread(n, min(n, self.max_num_reqs))))
        self._forward(n, metadata)
        torch.cuda.synchronize()
        self._forward(n, metadata, runtime_mode=CUDAGraphMode.PIECEWISE, descriptor=desc)
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step; its results are on the host once ``get_output()`` returns.

        A step with ``pending_structured_output_tokens`` (async scheduling: the bitmask of
        its structured requests follows tokens of the step before it, still in flight) runs
        its forward only and returns None; the logits stay on the device until
        ``sample_tokens`` masks them with the bitmask and samples."""
        if self._unsampled is not None:
            raise RuntimeError("a step was launched while the previous one still waits for sample_tokens()")
        step = self._launch(scheduler_output)
        self.kv_transfer.end(scheduler_output)  # the KV connector's saves, its finished transfers
        if scheduler_output.pending_structured_output_tokens:
            self._unsampled = step
            return None
        if isinstance(step, UnsampledStep):
            step = self._sample(step, scheduler_output.structured_output_request_ids, scheduler_output.grammar_bitmask)
        return self.kv_transfer.attach(step)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Sample the step ``execute_model`` launched without sampling, its structured
        requests' logits masked with ``grammar_output`` (None: no row, every structured
        request of the step finished meanwhile)."""
        step, self._unsampled = self._unsampled, None
        if step is None:
            raise RuntimeError("sample_tokens() without a step launched with pending_structured_output_tokens")
        if isinstance(step, UnsampledStep):  # else no logits (every request failed): already complete
            rows = grammar_output.structured_output_request_ids if grammar_output is not None else {}
            step = self._sample(step, rows, grammar_output.grammar_bitmask if grammar_output is not None else None)
        return self.kv_transfer.attach(step)

    def _launch(self, scheduler_output: SchedulerOutput) -> UnsampledStep | PendingModelRunnerOutput:
        """The step's forward up to the logits; a complete output where nothing samples."""
        self._update_states(scheduler_output)
        self.kv_transfer.begin(scheduler_output)  # the KV connector's loads start (a failed one fails its request)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return _empty_step()
        scheduled, failures = scheduler_output.num_scheduled_tokens, self.failures
        req_ids = [r for r in scheduled if r not in failures] if failures else list(scheduled)
        if not req_ids:  # every scheduled request has failed
            self.inputs.forget_sampled()
            return _empty_step(list(scheduled), failures.of(scheduled))
        batch, common = self.inputs.prepare(scheduler_output, req_ids, self.input_batch)
        batch.failed_req_ids = [r for r in scheduled if r in failures] if failures else []
        if not self.pp_last:
            # An earlier pipeline stage: forward its layers, hand the stream on; the last
            # stage samples and its output is the step's.
            self._forward(batch.num_tokens, self.builder.build(common), self._lora_extras(batch))
            return _empty_step()

        b, logits, hidden = len(batch.req_ids), None, None
        # LoRA steps run without graphs: the captured graphs hold no adapter updates.
        mode, descriptor = CUDAGraphMode.NONE, None
        if self.lora_manager is None:
            mode, descriptor = self.dispatcher.dispatch(batch.num_tokens, batch.uniform_decode)
        if mode == CUDAGraphMode.FULL:
            assert self.cudagraphs is not None and descriptor is not None
            size = self.cudagraphs.prepare(b, descriptor.num_tokens, self.builder)
            self.inputs.mark_copied()
            self.kv_transfer.before_graph()  # a graph runs no per-layer code: every layer's loads first
            logits = self.cudagraphs.replay(size, batch.num_tokens)  # every token's logits
            if batch.num_logits != batch.num_tokens:  # a request of the batch verifies fewer drafts
                logits = logits[self.inputs.logits_indices[: batch.num_logits]]
        else:
            attn_metadata = self.builder.build(common)
            self.inputs.mark_copied()
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
            assert hidden is not None
            logits = self.compute_logits(hidden[self.inputs.logits_indices[: batch.num_logits]])
        return UnsampledStep(batch, logits, hidden)

    def _sample(
        self, step: UnsampledStep, rows: dict[str, int], bitmask: torch.Tensor | None
    ) -> PendingModelRunnerOutput:
        """Mask (structured requests), sample on the device, start copying the tokens to
        the host, and return what waits for them."""
        if self.spec is not None:  # verify the drafts, propose the next ones: kvloom.worker.speculation
            self.inputs.forget_sampled()
            return self.spec.sample(step, rows, bitmask)
        batch, logits = step.batch, step.logits
        if bitmask is not None and logits is not None:
            # Masked in float32, the dtype every grammar kernel takes (the LM head gives the
            # model dtype); only steps with structured requests pay for the copy.
            logits = logits.float()
            apply_grammar_bitmask(logits, batch.req_ids, rows, bitmask)
        states = batch.states
        # A request still prefilling its prompt produces no token this step.
        done_prefill = [seq_len >= s.num_tokens for seq_len, s in zip(batch.seq_lens.tolist(), states)]
        gen_idx = [i for i, s in enumerate(states) if s.sampling_params is not None]
        tokens = None
        if gen_idx:
            assert logits is not None
            out, gen_idx = self.sampler.sample(logits, states, gen_idx, self.inputs.in_flight_tokens)
        self.inputs.forget_sampled()
        if gen_idx:
            tokens = self.outputs.copy_to_host(out, gen_idx, done_prefill, states)
            self.inputs.record_sampled(out.sampled_token_ids, tokens.placeholders.rows, tokens.sample_rows)
        return self.outputs.pending(batch, step.hidden, done_prefill, tokens)

    # ------------------------------------------------------------------ state updates
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch, failures = self.input_batch, self.failures
        for req_id in scheduler_output.finished_req_ids:
            batch.remove(req_id)
            failures.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            batch.remove(new.req_id)  # a resumed request replaces its old state
            if new.req_id not in failures:
                failures.run(new.req_id, "setting up its state", self._add_request_state, new)
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.req_id in failures:
                continue
            state = batch[cached.req_id]
            if cached.num_kept_blocks is not None:  # speculative decoding gave blocks back
                batch.keep_blocks(state, cached.num_kept_blocks)
            batch.append_blocks(state, cached.new_block_ids)
            if cached.new_token_ids is not None and not self.pp_last:
                # Pipeline parallelism: the last stage sampled these; this stage learns them here.
                batch.write_tokens(state, cached.num_computed_tokens, cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        if self.spec is not None:
            self.spec.update(scheduler_output)
        if self.lora_manager is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                state = batch.requests.get(req_id)
                if state is not None and state.lora_request is not None and req_id not in failures:
                    failures.run(req_id, f"loading its LoRA adapter {state.lora_request.lora_name!r}",
                                 self.lora_manager.ensure_loaded, state.lora_request)  # fmt: skip

    def _add_request_state(self, new: Any) -> None:
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
            generator=self.sampler.make_generator(params.seed if params is not None else None),
            eos_token_id=new.eos_token_id,
        )

    # ------------------------------------------------------------------ forward
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
        inputs = self.inputs
        inputs.zero_padding(n, padded)
        intermediate = None
        if not self.pp_first:
            hidden_size = self.config.model.hf_config.hidden_size
            packed = torch.empty(2, n, hidden_size, dtype=self.config.model.dtype, device=self.device)
            intermediate = IntermediateTensors.unpack(parallel_state.recv_from_previous_stage(packed))
        with set_forward_context(attn_metadata, attn_layers=self._attn_by_name, num_actual_tokens=n,
                                 cudagraph_runtime_mode=runtime_mode if self.pp_last else CUDAGraphMode.NONE,
                                 batch_descriptor=descriptor if self.pp_last else None,
                                 kv_connector=self.kv_transfer.layer_hooks, **(extras or {})):  # fmt: skip
            out = self.run_model(inputs.input_ids[:padded], inputs.positions[:padded], intermediate)
        if self.pp_last:
            return out[:n]
        self._send_to_next_stage(out.pack())
        return None

    def _send_to_next_stage(self, packed: torch.Tensor) -> None:
        """Start sending ``packed`` to the next stage without waiting for it to arrive (the
        next stage may still be busy with the previous micro-batch): this stage goes on
        with its next step. The previous send is finished first, so at most one is open."""
        if self._pp_send is not None:
            self._pp_send[0].wait()
        self._pp_send = (parallel_state.send_to_next_stage(packed), packed)

    def _lora_extras(self, batch: StepBatch) -> dict[str, Any]:
        """The forward-context extras of a step: each token's LoRA adapter slot."""
        if self.lora_manager is None:
            return {}
        return self.lora_manager.forward_extras([s.lora_request for s in batch.states], batch.query_lens)

    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int, num_reqs: int | None = None, rows_per_req: int = 1) -> torch.Tensor:
        """A forward over ``num_tokens`` tokens spread over ``num_reqs`` requests, with
        every KV write disabled (slot -1), for memory profiling and warm-up; the logits of
        ``rows_per_req`` tokens per request (speculative decoding verifies 1 + k)."""
        num_reqs = min(num_reqs or 1, num_tokens, self.max_num_reqs)
        common = self.inputs.dummy_metadata(_spread(num_tokens, num_reqs), self.max_model_len)
        hidden = self._forward(num_tokens, self.builder.build(common))
        if hidden is None:  # a pipeline stage before the last: no logits here
            return torch.empty(0, device=self.device)
        num_logits = min(num_reqs * rows_per_req, num_tokens)
        last = hidden[self.inputs.logits_indices[:num_reqs]] if num_logits == num_reqs else hidden[:num_logits]
        if self.config.model.runner == "pooling":  # embedding models have no LM head
            return last
        return self.compute_logits(last)

    # ------------------------------------------------------------------ LoRA
    def _loras(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the LoRA manager; ValueError without ``--enable-lora``."""
        return self._loras().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded (or LoRA is off)."""
        return self.lora_manager.remove_adapter(lora_id) if self.lora_manager is not None else False

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        return self.lora_manager.list_adapters() if self.lora_manager is not None else set()

    def shutdown(self) -> None:
        """Release what the KV connector holds."""
        self.kv_transfer.shutdown()


def _spread(num_tokens: int, num_reqs: int) -> np.ndarray:
    """Query lengths of ``num_reqs`` requests sharing ``num_tokens`` tokens as evenly as can be."""
    query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    query_lens[: num_tokens % num_reqs] += 1
    return query_lens

