"""Host-side launchers of the Triton kernels: shapes in, grids and constexprs out.

Nothing here synchronises with the device or reads a device tensor's values; grids depend
on tensor shapes and the host integers the caller passes (batch size, split plan), which
is what lets these launches be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import cdiv, min_split_tiles
from kvloom_backend_triton.config import KernelConfig, next_power_of_2
from kvloom_backend_triton.kernels import (
    decode_attention_kernel,
    decode_reduce_kernel,
    mixed_batch_attention_kernel,
    write_kv_kernel,
)

LOG2_E = 1.4426950408889634
#: Smallest M of a tl.dot operand: decode pads the query-head group up to it.
MIN_DOT_ROWS = 16
#: Elements one cache-write program copies at most (heads x padded head size).
_WRITE_TILE_ELEMENTS = 4096


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots default to tf32 on tensor cores (~3e-4 relative error); "ieee" keeps full
    # fp32. The setting is ignored for 16-bit inputs.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class LayerFeatures:
    """A layer's attention features, as the kernels take them (all off by default)."""

    sliding_window: int | None = None
    """Each query sees the last ``sliding_window`` positions, its own included."""
    logits_soft_cap: float | None = None
    """Scaled scores ``s`` become ``cap * tanh(s / cap)``."""
    sinks: torch.Tensor | None = None
    """``[num_heads]`` sink logits (any float dtype), added to every softmax's denominator."""

    def kernel_args(self, query: torch.Tensor) -> tuple[torch.Tensor, int, float]:
        """``(sinks_ptr, window, soft_cap)``: the runtime arguments (the log2-domain cap;
        ``query`` stands in for an absent sinks tensor, never read)."""
        if self.sinks is not None and (self.sinks.dim() != 1 or self.sinks.shape[0] != query.shape[1]):
            raise ValueError(f"sinks must have shape ({query.shape[1]},), got {tuple(self.sinks.shape)}")
        cap = 0.0 if self.logits_soft_cap is None else self.logits_soft_cap * LOG2_E
        return (query if self.sinks is None else self.sinks), self.sliding_window or 0, cap

    def constexprs(self) -> dict[str, bool]:
        return {"WINDOW": self.sliding_window is not None, "SOFT_CAP": self.logits_soft_cap is not None,
                "SINKS": self.sinks is not None}


NO_FEATURES = LayerFeatures()


def _check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the head dimension must be contiguous (stride {tensor.stride(-1)})")


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key and value caches must share shape and strides, got {tuple(key_cache.shape)}/"
            f"{key_cache.stride()} and {tuple(value_cache.shape)}/{value_cache.stride()}"
        )
    _check_inner_contiguous("kv_cache", key_cache)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``key_cache.view(-1, H, D)[slot_mapping[t]] = key[t]`` (same for value), skipping -1.

    key/value ``[N, num_kv_heads, head_size]``; caches ``[num_blocks, block_size,
    num_kv_heads, head_size]`` (any block/slot/head strides, contiguous head dim).
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _check_cache(key_cache, value_cache)
    _check_inner_contiguous("key", key)
    _check_inner_contiguous("value", value)
    block_d = next_power_of_2(head_size)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _WRITE_TILE_ELEMENTS // block_d))
    grid = (num_tokens, cdiv(num_kv_heads, block_h))
    write_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads,
        PAGE_SIZE=key_cache.shape[1], HEAD_SIZE=head_size, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def mixed_batch_tiles(group: int, max_query_len: int, cfg: KernelConfig) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: rows per program and query tokens per program.

    Rows are (query token x group member); a batch of short queries gets a smaller tile
    so decode-like requests in a mixed batch waste fewer rows.
    """
    rows_needed = max(MIN_DOT_ROWS, next_power_of_2(group * max(1, max_query_len)))
    block_m = max(min(cfg.prefill_block_m, rows_needed), next_power_of_2(group), MIN_DOT_ROWS)
    return block_m, max(1, block_m // group)


def mixed_batch_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    cfg: KernelConfig,
    skip_single: bool = False,
    features: LayerFeatures = NO_FEATURES,
) -> None:
    """Causal paged attention for requests laid out by ``query_start_loc`` (any mix of
    prefill chunks with cached context and decodes). Writes ``output[:query_start_loc[-1]]``,
    except, with ``skip_single``, the rows of requests of one query token (which
    ``decode_attention`` computes). ``features``: the layer's window, soft cap and sinks."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return
    _check_cache(key_cache, value_cache)
    _check_inner_contiguous("query", query)
    _check_inner_contiguous("output", output)
    group = num_heads // num_kv_heads
    block_m, block_q = mixed_batch_tiles(group, max_query_len, cfg)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    sinks, window, soft_cap = features.kernel_args(query)
    mixed_batch_attention_kernel[grid](
        query, key_cache, value_cache, output,
        query_start_loc, seq_lens, block_table, sinks,
        scale * LOG2_E, window, soft_cap, num_reqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        GROUP=group, PAGE_SIZE=key_cache.shape[1], HEAD_SIZE=head_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.prefill_block_n,
        BLOCK_D=next_power_of_2(head_size), DOT_PRECISION=_dot_precision(query.dtype), SKIP_SINGLE=skip_single,
        **features.constexprs(),
        num_warps=cfg.prefill_num_warps,
        num_stages=cfg.prefill_num_stages,
    )


def plan_decode_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, cfg: KernelConfig
) -> int:
    """How many splits the decode kernel cuts each request's positions into.

    Enough (request, KV head, split) programs to give every SM ``programs_per_sm`` of
    them, but no split shorter than ``min_split_tokens`` (the reduction and the partial
    writes must stay small next to the KV reads) and at most ``max_splits``. The kernel
    sizes each request's splits from its own length, so a request shorter than
    ``max_seq_len`` still spreads its positions over the splits, in runs of at least
    ``min_split_tokens`` (``kvloom.interfaces.min_split_tiles``: a request that short is
    not split, whatever the plan). ``max_seq_len`` is the longest sequence the launch may
    meet: the step's longest in eager mode, ``max_model_len`` for a CUDA graph.
    """
    max_seq_len = max(1, max_seq_len)
    if cfg.force_num_splits is not None:
        splits = cfg.force_num_splits
    else:
        wanted = cdiv(cfg.programs_per_sm * num_sms, max(1, num_reqs * num_kv_heads))
        splits = min(wanted, cdiv(max_seq_len, cfg.min_split_tokens), cfg.max_splits)
    # No more splits than tiles: a split holds whole tiles.
    return max(1, min(splits, cdiv(max_seq_len, cfg.decode_block_n)))


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    scale: float,
    num_splits: int,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    cfg: KernelConfig,
    features: LayerFeatures = NO_FEATURES,
) -> None:
    """Paged attention for the requests of exactly one query token (flash-decoding); the
    others, if any, are skipped (see ``mixed_batch_attention(skip_single=True)``).

    With ``num_splits > 1`` each request's positions are cut into ``num_splits`` runs
    processed by separate programs, whose partial results land in ``partial_out``
    ``[>= num_reqs*num_splits, num_heads, head_size]`` and ``partial_lse``
    ``[>= num_reqs*num_splits, num_heads]`` (float32) and are merged by a second kernel
    (which adds the sinks, if any). ``features``: the layer's window, soft cap and sinks.
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if num_reqs == 0:
        return
    _check_cache(key_cache, value_cache)
    _check_inner_contiguous("query", query)
    _check_inner_contiguous("output", output)
    split = num_splits > 1
    if split and (partial_out.shape[0] < num_reqs * num_splits or partial_lse.shape[0] < num_reqs * num_splits):
        raise ValueError(
            f"decode workspace holds {partial_out.shape[0]} rows, {num_reqs} requests x {num_splits} splits need more"
        )
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_size)
    sinks, window, soft_cap = features.kernel_args(query)
    flags = features.constexprs()
    decode_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, output, partial_out, partial_lse,
        query_start_loc, seq_lens, block_table, sinks,
        scale * LOG2_E, window, soft_cap,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0),
        GROUP=group, PAGE_SIZE=key_cache.shape[1], HEAD_SIZE=head_size,
        BLOCK_G=max(MIN_DOT_ROWS, next_power_of_2(group)), BLOCK_N=cfg.decode_block_n, BLOCK_D=block_d,
        SPLIT=split, DOT_PRECISION=_dot_precision(query.dtype),
        MIN_SPLIT_TILES=min_split_tiles(cfg.min_split_tokens, cfg.decode_block_n, cfg.force_num_splits),
        **flags, num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
    )
    if split:
        decode_reduce_kernel[(num_reqs, num_heads)](
            partial_out, partial_lse, output, query_start_loc, sinks, num_splits,
            partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0),
            output.stride(0), output.stride(1),
            HEAD_SIZE=head_size, BLOCK_S=next_power_of_2(num_splits), BLOCK_D=block_d, SINKS=flags["SINKS"],
            num_warps=4 if block_d * next_power_of_2(num_splits) >= 2048 else 1,
        )
