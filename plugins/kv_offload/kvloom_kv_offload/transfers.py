"""The worker side's copies between the device KV cache and the host tier.

The host tier is one buffer per layer, ``[num_slots, *block_shape]``, pinned on CUDA at its
exact size (``pinned_empty``). A
transfer moves blocks between device block ids (anywhere in the cache) and host slots:
the device side is gathered or scattered on the device (``KVLayerCache``, one indexed
copy per layer through a staging buffer), the host side is copied in runs of consecutive
slots, each one DMA copy. On CUDA, loads run on a stream of their own and stores on
another; each waits for the other's earlier copies (a slot may be reused between them)
and stores wait for the forward that wrote their blocks. Each transfer records an event;
its completion is polled, never waited for on the step's path. On the CPU every copy is
done when it returns.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch

from kvloom.interfaces import KVLayerCache


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first row, first slot, length)`` of each run of consecutive slots in ``slots``."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, length = runs[-1]
            runs[-1] = (first_row, first_slot, length + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor page-locked at exactly its own size (unregistered when it is freed).

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
    rounds each block up to the next power of two: an 80 GiB tier of 32 layers (2.5 GiB
    each) asked for 128 GiB of pinned memory and the engine was killed on the H200's
    128 GiB host (2026-11-29). Pageable memory registered with ``cudaHostRegister`` is
    pinned as it is, and the copy engines read it as they read pinned memory."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes == 0:
        return tensor
    cudart, ptr = torch.cuda.cudart(), tensor.data_ptr()
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, nbytes, 0))
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return tensor


@dataclass
class Transfer:
    """One issued transfer: done when its event has passed (CUDA) or at once (CPU)."""

    request_id: str
    blocks: int
    nbytes: int
    started: float
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.end_event is None or self.end_event.query()

    def seconds(self) -> float:
        if self.start_event is not None and self.end_event is not None:
            return self.start_event.elapsed_time(self.end_event) / 1000.0
        return time.perf_counter() - self.started


class HostTier:
    """The host buffers of every layer and the copies in and out of them."""

    def __init__(self, layers: dict[str, KVLayerCache], num_slots: int) -> None:
        self.layers = layers
        first = next(iter(layers.values()))
        self.device = first.tensor.device
        self.cuda = self.device.type == "cuda"
        self.buffers = {
            name: (pinned_empty if self.cuda else torch.empty)((num_slots, *c.block_shape), dtype=c.tensor.dtype)
            for name, c in layers.items()
        }
        self.block_nbytes = sum(c.block_nbytes for c in layers.values())
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.store_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _events(self) -> tuple[torch.cuda.Event | None, torch.cuda.Event | None]:
        if not self.cuda:
            return None, None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def load(self, request_id: str, slots: list[int], block_ids: list[int]) -> Transfer:
        """Copy host ``slots`` into device blocks ``block_ids`` (in order)."""
        start, end = self._events()
        transfer = Transfer(request_id, len(slots), len(slots) * self.block_nbytes, time.perf_counter(), start, end)
        stream = self.load_stream
        if stream is not None:
            assert self.store_stream is not None and start is not None and end is not None
            # The blocks may have been another request's until now (its queued steps write
            # them), and a slot just stored to is read back here.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_stream(self.store_stream)
            stream.record_event(start)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        runs = slot_runs(slots)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ids = ids.to(self.device, non_blocking=True)
            for name, cache in self.layers.items():
                host = self.buffers[name]
                staging = torch.empty((len(slots), *cache.block_shape), dtype=host.dtype, device=self.device)
                for row, slot, length in runs:
                    staging[row : row + length].copy_(host[slot : slot + length], non_blocking=True)
                cache.scatter(ids, staging)
            if stream is not None:
                stream.record_event(end)
        return transfer

    def store(self, request_id: str, block_ids: list[int], slots: list[int]) -> Transfer:
        """Copy device blocks ``block_ids`` into host ``slots`` (in order), after the work
        queued on the device so far (the forward that wrote them)."""
        start, end = self._events()
        transfer = Transfer(request_id, len(slots), len(slots) * self.block_nbytes, time.perf_counter(), start, end)
        stream = self.store_stream
        if stream is not None:
            assert self.load_stream is not None and start is not None and end is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_stream(self.load_stream)  # a slot may still be read by an earlier load
            stream.record_event(start)
        runs = slot_runs(slots)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ids = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            for name, cache in self.layers.items():
                staging = cache.gather(ids)
                host = self.buffers[name]
                for row, slot, length in runs:
                    host[slot : slot + length].copy_(staging[row : row + length], non_blocking=True)
            if stream is not None:
                stream.record_event(end)
        return transfer

    def fence_stores(self) -> None:
        """Make the device's next work wait for the stores issued so far (their blocks may be
        reused by it)."""
        if self.store_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.store_stream)

    def wait_stores(self) -> None:
        """Block until the stores issued so far are in host memory (before the host reads them)."""
        if self.store_stream is not None:
            self.store_stream.synchronize()

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """The host copy of one slot, one tensor per layer (views)."""
        return [buffer[slot] for buffer in self.buffers.values()]
