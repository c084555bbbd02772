"""The out-of-tree test backend (tests/plugins/oot_backend) computes correct attention.

The install tests use it as a real backend; here it is imported straight from its
source directory (no entry points involved) and compared with a float64 reference on
fresh random paged data: a prefill continuing a cached prefix, a decode step and a fresh
prefill in one batch, GQA, a padded token whose slot is -1.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata

SOURCE = Path(__file__).resolve().parents[1] / "plugins" / "oot_backend"


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> type:
    monkeypatch.syspath_prepend(str(SOURCE))
    from kvloom_test_oot_backend.backend import OotTestAttentionBackend

    return OotTestAttentionBackend


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64 for the last ``len(q)`` positions of ``k``/``v``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq_len, query_len = k.shape[0], q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_against_float64_reference(backend: type, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 4, 2, 64, 8, 16
    scale = 1 / math.sqrt(head_size)
    # (cached context tokens, new tokens) per request: chunked prefill, decode, fresh prefill
    shapes = [(11, 6), (20, 1), (0, 9)]
    kv_cache = torch.randn(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), generator=gen).to(dtype)
    key_cache, value_cache = backend.split_kv_cache(kv_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = 4
    block_table = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    full_k, full_v, queries, keys, values, slots = [], [], [], [], [], []
    for i, (context, new) in enumerate(shapes):
        seq_len = context + new
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        block_table[i, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        token_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        for p in range(context):  # the cached prefix is already in the paged cache
            key_cache.view(-1, num_kv_heads, head_size)[token_slots[p]] = k[p]
            value_cache.view(-1, num_kv_heads, head_size)[token_slots[p]] = v[p]
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(new, num_heads, head_size, generator=gen).to(dtype))
        keys.append(k[context:])
        values.append(v[context:])
        slots += token_slots[context:]
    # One CUDA-graph style padding token: slot -1, must not be written.
    query = torch.cat(queries + [torch.randn(1, num_heads, head_size, generator=gen).to(dtype)])
    key = torch.cat(keys + [torch.full((1, num_kv_heads, head_size), 1e4, dtype=dtype)])
    value = torch.cat(values + [torch.full((1, num_kv_heads, head_size), 1e4, dtype=dtype)])
    slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64)
    query_lens = [new for _, new in shapes]
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        num_reqs=len(shapes),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_size, dtype, dtype, block_size, 8, 64, scale)
    metadata = backend.get_builder_cls()(spec, torch.device("cpu"), max_blocks).build(common)
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
    output = torch.full((query.shape[0], num_heads, head_size), float("nan"), dtype=dtype)
    impl.forward(query, key, value, kv_cache, metadata, output)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (context, new) in enumerate(shapes):
        start = int(query_start_loc[i])
        expected = reference(queries[i], full_k[i], full_v[i], scale)
        torch.testing.assert_close(output[start : start + new].double(), expected, atol=tol, rtol=tol)
        # The new tokens' keys and values were written where the slot mapping says.
        blocks = block_table[i, : -(-(context + new) // block_size)].long()
        cached_k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[: context + new]
        torch.testing.assert_close(cached_k, full_k[i], atol=0, rtol=0)
    assert not (key_cache == 1e4).any() and not (value_cache == 1e4).any()  # padding skipped
