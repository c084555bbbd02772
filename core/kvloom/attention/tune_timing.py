"""Timing one attention step of a backend, for ``kvloom backends tune`` (``tuning.py``).

A step is what the model runner does for attention: the builder's per-step work (its
``build``; before a full CUDA graph's replay its ``build_for_cudagraph_capture``, which
refreshes the graph's persistent state) and then one forward per layer, K/V write
included. Steps are issued back to back without waiting in between, as the engine issues
them, and the wall time of ``iters`` steps is divided by ``iters``: where a backend's host
work per step outlasts its device work, the host work is what the step costs.

The batch is drawn at random on the device: every request on shuffled physical blocks of
one KV cache that all layers share (the bytes each layer reads are those of a real layer;
a cache per layer would only cost memory). On CUDA, uniform decode steps replay a captured
graph of the layers' forwards where the backend supports one; elsewhere (and on the CPU,
which the tests use as a smoke run) the forwards run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
)
from kvloom.attention.kv_quant import kv_cache_torch_dtype
from kvloom.attention.tuning import StepCase
from kvloom.utils import cdiv


def _common_metadata(case: StepCase, block_size: int, device: torch.device) -> tuple[CommonAttentionMetadata, int]:
    """The step's metadata over randomly placed blocks; the number of blocks."""
    gen = torch.Generator().manual_seed(0)
    blocks = [cdiv(s, block_size) for s in case.seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    slots, start = [], 0
    for row, (n, q_len, s_len) in enumerate(zip(blocks, case.query_lens, case.seq_lens)):
        block_table[row, :n] = perm[start : start + n]
        start += n
        positions = torch.arange(s_len - q_len, s_len)
        slots.append(block_table[row, positions // block_size].long() * block_size + positions % block_size)
    query_start_loc = torch.zeros(len(blocks) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(case.query_lens).cumsum(0)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens.to(device), block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device), num_reqs=len(blocks), num_actual_tokens=sum(case.query_lens),
        max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens), query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )  # fmt: skip
    return common, num_blocks


@torch.inference_mode()
def step_time(
    backend: type[AttentionBackend],
    config: AttentionSelectorConfig,
    case: StepCase,
    num_layers: int,
    device: torch.device,
    warmup: int = 3,
    iters: int = 20,
) -> float:
    """Milliseconds of one attention step of ``case`` over ``num_layers`` layers with
    ``backend`` at ``config`` (its ``block_size`` set), on ``device``."""
    if config.num_heads is None or config.num_kv_heads is None or config.block_size is None:
        raise ValueError("step_time needs the model's heads and the block size in the selector config")
    heads, kv_heads, head_size, block_size = config.num_heads, config.num_kv_heads, config.head_size, config.block_size
    common, num_blocks = _common_metadata(case, block_size, device)
    scale = head_size**-0.5
    spec = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, dtype=config.dtype,
                              kv_cache_dtype=kv_cache_torch_dtype(config.kv_cache_dtype, config.dtype), block_size=block_size,
                              max_num_seqs=common.num_reqs, max_model_len=common.max_seq_len, scale=scale)  # fmt: skip
    builder = backend.get_builder_cls()(spec, device, common.block_table.shape[1])
    impl = backend.get_impl_cls()(num_heads=heads, head_size=head_size, scale=scale, num_kv_heads=kv_heads,
                                  kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip
    shape = backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
    kv_cache = torch.randn(shape, device=device, dtype=config.dtype).to(spec.kv_cache_dtype)
    n = common.num_actual_tokens
    query = torch.randn(n, heads, head_size, device=device, dtype=config.dtype)
    key = torch.randn(n, kv_heads, head_size, device=device, dtype=config.dtype)
    value = torch.randn(n, kv_heads, head_size, device=device, dtype=config.dtype)
    output = torch.empty_like(query)

    def layers(metadata: object) -> None:
        for _ in range(num_layers):
            impl.forward(query, key, value, kv_cache, metadata, output)

    step: Callable[[], None]
    cuda = device.type == "cuda"
    if cuda and case.decode and backend.cudagraph_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        metadata = builder.build_for_cudagraph_capture(common)
        layers(metadata)  # compile and autotune outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers(metadata)

        def step() -> None:
            builder.build_for_cudagraph_capture(common)
            graph.replay()
    else:

        def step() -> None:
            layers(builder.build(common))

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    wait()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    wait()
    return (time.perf_counter() - start) * 1000.0 / iters
