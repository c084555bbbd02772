"""Full CUDA graphs for uniform single-token decode batches: the FULL runtime mode.

The ``CudagraphDispatcher`` (``kvloom.worker.cudagraph_dispatcher``) sends a uniform decode
batch here when the resolved mode has full decode graphs (FULL_DECODE_ONLY,
FULL_AND_PIECEWISE); the key's ``num_tokens`` is the capture size. The graph records the
model forward (compiled or eager; inside it the piecewise wrappers stay out of the way)
and the LM head. Async scheduling relies on the split into ``prepare`` (inputs padded and
the backend's persistent state refreshed, every host->device copy queued) and ``replay``.

A decode batch of b requests is padded up to the smallest capture size B >= b with
dummy requests (query length 1, seq_len 1, block-table row 0, slot -1); the graph covers
the model forward and the LM head, so a replay yields logits for the B rows.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvloom.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.forward_context import BatchDescriptor, set_forward_context

if TYPE_CHECKING:
    from kvloom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def effective_decode_graphs(mode: CUDAGraphMode, support: AttentionCGSupport) -> bool:
    """Whether uniform decode batches run as full graphs for this mode and backend."""
    if mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        return False
    return support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class CUDAGraphRunner:
    def __init__(self, runner: "ModelRunner", capture_sizes: list[int], pool: Any = None) -> None:
        self.runner = runner
        self.sizes = sorted(s for s in capture_sizes if s <= runner.max_num_reqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool

    def _padded_metadata(self, b: int, size: int) -> CommonAttentionMetadata:
        """Pad the runner's buffers (already holding b real decode rows) to ``size``."""
        r = self.runner
        pad = size - b
        if pad:
            qsl = r.query_start_loc_cpu.numpy()
            qsl[b + 1 : size + 1] = np.arange(b + 1, size + 1)
            r.seq_lens_cpu.numpy()[b:size] = 1
            r.slot_mapping_cpu.numpy()[b:size] = -1
            r.input_ids_cpu.numpy()[b:size] = 0
            r.positions_cpu.numpy()[b:size] = 0
            r.block_table_cpu[b:size].zero_()
            r.query_start_loc[b + 1 : size + 1].copy_(r.query_start_loc_cpu[b + 1 : size + 1], non_blocking=True)
            r.seq_lens[b:size].copy_(r.seq_lens_cpu[b:size], non_blocking=True)
            r.slot_mapping[b:size].copy_(r.slot_mapping_cpu[b:size], non_blocking=True)
            r.input_ids[b:size].copy_(r.input_ids_cpu[b:size], non_blocking=True)
            r.positions[b:size].copy_(r.positions_cpu[b:size], non_blocking=True)
            r.block_table[b:size].copy_(r.block_table_cpu[b:size], non_blocking=True)
        return r.common_metadata(size, size, 1, int(r.seq_lens_cpu[:size].max()))

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        assert r.model is not None and r.builder is not None
        start = time.perf_counter()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        # Largest first so smaller graphs reuse the larger ones' memory pool.
        for size in reversed(self.sizes):
            common = r.dummy_metadata(np.ones(size, dtype=np.int64))
            r.input_ids[:size].zero_()
            r.positions[:size].zero_()
            metadata = r.builder.build_for_cudagraph_capture(common)
            # FULL: piecewise wrappers inside the compiled model run their pieces directly.
            context = {"attn_layers": r._attn_by_name, "cudagraph_runtime_mode": CUDAGraphMode.FULL,
                       "batch_descriptor": BatchDescriptor(size, True)}  # fmt: skip
            for _ in range(2):  # warm up (Triton JIT, cuBLAS handles, Dynamo) outside the graph
                with set_forward_context(metadata, **context):
                    r.model.compute_logits(r.run_model(r.input_ids[:size], r.positions[:size]))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                with set_forward_context(metadata, **context):
                    logits = r.model.compute_logits(r.run_model(r.input_ids[:size], r.positions[:size]))
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "Captured %d CUDA graphs for decode batch sizes %s in %.1f s",
            len(self.graphs),
            self.sizes,
            time.perf_counter() - start,
        )

    def prepare(self, b: int, size: int) -> int:
        """Pad the runner's inputs (b decode rows) to the captured ``size`` (the
        dispatcher's key) and refresh the backend's persistent state; returns ``size``.
        Every host->device copy of the step is queued when this returns."""
        if size not in self.graphs or size < b:
            raise ValueError(f"no full decode graph of size {size} for {b} requests (captured: {self.sizes})")
        padded = self._padded_metadata(b, size)
        self.runner.builder.build_for_cudagraph_capture(padded)  # refresh persistent state
        return size

    def replay(self, size: int, b: int) -> torch.Tensor:
        """Launch the graph ``prepare`` chose; the logits of the b real rows."""
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]
