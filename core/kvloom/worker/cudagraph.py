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

With speculative decoding a uniform decode batch has q = 1 + k tokens per request (the
last token and k drafts to verify): the graphs are captured for batches of q-token
requests (``StepInputs.uniform_query_len``), their sizes are token counts (requests x q),
and a replay yields the logits of every token, each a verified position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvloom.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    """The full decode graphs of one model: captured once, then prepared and replayed
    per step. It reads and pads the step's input buffers (``StepInputs``); ``run_decode``
    runs the model and its LM head over a decode batch of a given size under a forward
    context of the FULL runtime mode (the runner supplies it)."""

    def __init__(
        self,
        inputs: StepInputs,
        run_decode: Callable[[int, Any], torch.Tensor],
        capture_sizes: list[int],
        pool: Any = None,
    ) -> None:
        self.inputs = inputs
        self.run_decode = run_decode
        q = inputs.uniform_query_len
        self.sizes = sorted(s for s in capture_sizes if s % q == 0 and s // q <= inputs.max_num_reqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool

    @torch.inference_mode()
    def capture(self, builder: Any) -> None:
        start = time.perf_counter()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        # Largest first so smaller graphs reuse the larger ones' memory pool.
        for size in reversed(self.sizes):
            q = self.inputs.uniform_query_len
            common = self.inputs.dummy_metadata(np.full(size // q, q, dtype=np.int64))
            metadata = builder.build_for_cudagraph_capture(common)
            for _ in range(2):  # warm up (Triton JIT, cuBLAS handles, Dynamo) outside the graph
                self.run_decode(size, metadata)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.run_decode(size, metadata)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "Captured %d CUDA graphs for decode batch sizes %s in %.1f s",
            len(self.graphs),
            self.sizes,
            time.perf_counter() - start,
        )

    def prepare(self, b: int, size: int, builder: Any) -> int:
        """Pad the step's inputs (b decode requests) to the captured ``size`` tokens (the
        dispatcher's key) and refresh the backend's persistent state; returns ``size``.
        Every host->device copy of the step is queued when this returns."""
        if size not in self.graphs or size < b * self.inputs.uniform_query_len:
            raise ValueError(f"no full decode graph of size {size} for {b} requests (captured: {self.sizes})")
        builder.build_for_cudagraph_capture(self.inputs.pad_decode(b, size))  # refresh persistent state
        return size

    def replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """Launch the graph ``prepare`` chose; the logits of the ``num_tokens`` real tokens."""
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:num_tokens]
