"""The MLA Triton kernels compiled on a CUDA GPU against float64 references.

Skipped without a GPU (the CPU runs the same kernels in test_mla_kernels_interpret.py).
Thresholds as issue 17's acceptance: bf16 relative error under 1e-2 (fp16 5e-3, fp32 1e-5).
Shapes include DeepSeek-V2's latent (kv_lora_rank 512, rope 64) and its prefill head dims
(192 / 128), long contexts and forced splits.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kvloom.testing.mla_decode import make_decode_case
from kvloom_backend_triton_mla import ops

from kvloom.testing.reference import attend, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

DECODE = {
    # name: (seq_lens, num_heads, block_size, num_splits or None = planned)
    "v2lite_planned": ([1, 17, 700, 4096, 2100, 63], 16, 64, None),
    "v2lite_split7": ([3, 64, 511, 1500, 3000], 16, 16, 7),
    "heads128_block32": ([1, 300, 2049], 128, 32, None),
    "block1_one_split": ([5, 77], 16, 1, 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_matches_float64_reference(name: str, dtype: torch.dtype) -> None:
    seq_lens, num_heads, block_size, splits = DECODE[name]
    seed = zlib.crc32(f"{name}-{dtype}".encode())
    case = make_decode_case(seq_lens, num_heads=num_heads, kv_lora_rank=512, rope_dim=64, block_size=block_size,
                            dtype=dtype, device="cuda", seed=seed)
    cfg = ops.resolve_config(dtype)
    if splits is None:
        splits = ops.plan_num_kv_splits(len(seq_lens), num_heads, max(seq_lens),
                                        torch.cuda.get_device_properties(0).multi_processor_count, cfg)
    out = torch.full((len(seq_lens), num_heads, 512), float("nan"), dtype=dtype, device="cuda")
    ops.mla_decode(case.q[..., :512], case.q[..., 512:], case.kv_cache, case.block_table, case.seq_lens, out,
                   case.scale, splits, cfg)
    torch.cuda.synchronize()
    err = relative_error(out, case.reference())
    assert err < TOLERANCE[dtype], f"seed {seed}, {splits} splits: rel error {err:.3e}"


def test_decode_graph_replay_with_new_lengths() -> None:
    """One captured launch (fixed split count) replays correctly after the lengths and
    block table in its buffers change: the split size is derived in the kernel."""
    dtype = torch.bfloat16
    cases = [
        make_decode_case(lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64, dtype=dtype,
                         device="cuda", seed=seed)
        for seed, lens in enumerate(([40, 900, 3000], [3000, 7, 1500]))
    ]
    # Persistent buffers big enough for both cases, as a model runner's are.
    q = torch.empty_like(cases[0].q)
    cache = torch.empty((max(c.kv_cache.shape[0] for c in cases), 64, 576), dtype=dtype, device="cuda")
    bt = torch.zeros((3, max(c.block_table.shape[1] for c in cases)), dtype=torch.int32, device="cuda")
    lens = torch.empty(3, dtype=torch.int32, device="cuda")
    out = torch.empty(3, 16, 512, dtype=dtype, device="cuda")
    cfg = ops.resolve_config(dtype)
    work = ops.decode_workspace(3, 16, 512, 8, "cuda")

    def load(case) -> None:  # type: ignore[no-untyped-def]
        q.copy_(case.q)
        cache[: case.kv_cache.shape[0]].copy_(case.kv_cache)
        bt.zero_()
        bt[:, : case.block_table.shape[1]].copy_(case.block_table)
        lens.copy_(case.seq_lens)

    def launch() -> None:
        ops.mla_decode(q[..., :512], q[..., 512:], cache, bt, lens, out, cases[0].scale, 8, cfg, *work)

    load(cases[0])
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for case in (cases[1], cases[0]):
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, case.reference())
        assert err < TOLERANCE[dtype], f"replay: rel error {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefill_matches_float64_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    query_lens, key_lens, heads = [300, 1, 129, 64], [300, 900, 129, 1000], 16
    q = torch.randn(sum(query_lens), heads, 192, generator=gen).to(dtype).cuda()
    k = torch.randn(sum(key_lens), heads, 192, generator=gen).to(dtype).cuda()
    v = torch.randn(sum(key_lens), heads, 128, generator=gen).to(dtype).cuda()
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(key_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = torch.full((q.shape[0], heads, 128), float("nan"), dtype=dtype, device="cuda")
    ops.varlen_causal_attention(q, k, v, out, cu_q, cu_k, max(query_lens), 192**-0.5, ops.resolve_config(dtype))
    torch.cuda.synchronize()
    cq, ck = cu_q.tolist(), cu_k.tolist()
    ref = torch.cat([attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], 192**-0.5)
                     for b in range(len(query_lens))])
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"rel error {err:.3e}"
