"""``CUDAGraphWrapper``: capture a callable as one CUDA graph per ``BatchDescriptor``.

The wrapper has a runtime mode of its own (PIECEWISE for a compiled piece, FULL for a
whole forward) and acts only when the forward context's ``cudagraph_runtime_mode`` is that
mode; otherwise it calls the wrapped callable (eager steps, the warm-up, and the pieces
inside a FULL graph's capture). For a descriptor it has not seen it captures (the caller
runs a warm-up at that size first); afterwards it replays and returns the captured outputs.

Addresses: a replay reads its inputs from the addresses seen at capture. The model
runner's input buffers are persistent, a piece's inputs are the previous pieces' captured
outputs and the attention op writes into a buffer the previous piece allocated, so the
addresses repeat; the wrapper checks this on every replay and raises if one moved
(a wrong replay would silently read stale memory).

Memory: all graphs share one pool and are captured in the order they replay. Outputs are
kept as non-owning views, so a later capture may reuse an earlier piece's output memory,
exactly as the next piece would at replay. Hence a replayed output is valid until the next
forward: the model runner copies the hidden states it keeps past the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.forward_context import BatchDescriptor, current_forward_context

logger = logging.getLogger(__name__)


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep the memory alive."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


def weak_ref_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return weak_ref_tensor(out)
    if isinstance(out, (tuple, list)):
        return type(out)(weak_ref_outputs(o) for o in out)
    return out  # SymInt/int outputs are plain values


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    #: Which arguments are tensors, and their addresses at capture.
    tensor_args: list[int]
    input_addresses: list[int]
    output: Any


class CUDAGraphWrapper:
    """Wraps ``runnable`` for ``runtime_mode`` (PIECEWISE or FULL); see the module docstring.
    ``pool`` is the graph memory pool all of a model runner's graphs share."""

    def __init__(self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode, pool: Any, name: str = "") -> None:
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"CUDAGraphWrapper runtime_mode must be PIECEWISE or FULL, not {runtime_mode.value}")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.pool = pool
        self.name = name
        self.entries: dict[BatchDescriptor, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        ctx = current_forward_context()
        if ctx is None or ctx.cudagraph_runtime_mode != self.runtime_mode or ctx.batch_descriptor is None:
            return self.runnable(*args)
        key = ctx.batch_descriptor
        entry = self.entries.get(key)
        if entry is None:
            tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.runnable(*args)
            addresses = [args[i].data_ptr() for i in tensor_args]
            self.entries[key] = _Entry(graph, tensor_args, addresses, weak_ref_outputs(out))
            return out
        # The replay's host work, between two pieces on every layer: keep it to this check.
        addresses = [args[i].data_ptr() for i in entry.tensor_args]
        if addresses != entry.input_addresses:
            moved = [i for i, a, b in zip(entry.tensor_args, addresses, entry.input_addresses) if a != b]
            raise RuntimeError(
                f"CUDA graph {self.name} {key}: inputs {moved} are not at their captured addresses; "
                "a replay would read stale memory"
            )
        entry.graph.replay()
        return entry.output
