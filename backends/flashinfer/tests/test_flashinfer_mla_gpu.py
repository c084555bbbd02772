"""FLASHINFER_MLA on a CUDA GPU: FlashInfer's MLA paged-attention wrapper against the float64
reference, on the same random latent caches as TRITON_MLA's kernel tests.

Skipped without a GPU or without flashinfer (run on the device by ``tests/gpu/run.sh mla``).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvloom.testing.reference import relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("flashinfer")

from kvloom_backend_flashinfer.mla import FlashInferMLADecoder  # noqa: E402

from kvloom.testing.mla_decode import make_decode_case  # noqa: E402

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_decoder_matches_float64_reference(block_size: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 17, 700, 4096, 63]
    seed = zlib.crc32(f"fi-mla-{block_size}-{dtype}".encode())
    case = make_decode_case(seq_lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=block_size,
                            dtype=dtype, device="cuda", seed=seed)
    decoder = FlashInferMLADecoder("cuda")
    decoder.plan_decode(case.seq_lens.cpu(), case.block_table, block_size, 16, 512, 64, case.scale, dtype)
    out = torch.full((len(seq_lens), 16, 512), float("nan"), dtype=dtype, device="cuda")
    decoder.run(case.q, case.kv_cache, out)
    torch.cuda.synchronize()
    err = relative_error(out, case.reference())
    assert err < TOLERANCE[dtype], f"seed {seed}: rel error {err:.3e}"


def test_decoder_graph_replay_with_new_lengths() -> None:
    dtype = torch.bfloat16
    cases = [
        make_decode_case(lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64, dtype=dtype,
                         device="cuda", seed=seed)
        for seed, lens in enumerate(([40, 900, 3000], [3000, 7, 1500]))
    ]
    q = torch.empty_like(cases[0].q)
    cache = torch.empty((max(c.kv_cache.shape[0] for c in cases), 64, 576), dtype=dtype, device="cuda")
    bt = torch.zeros((3, max(c.block_table.shape[1] for c in cases)), dtype=torch.int32, device="cuda")
    out = torch.empty(3, 16, 512, dtype=dtype, device="cuda")
    decoder = FlashInferMLADecoder("cuda", max_num_seqs=4, max_pages=4 * bt.shape[1])

    def load(case) -> None:  # type: ignore[no-untyped-def]
        q.copy_(case.q)
        cache[: case.kv_cache.shape[0]].copy_(case.kv_cache)
        bt.zero_()
        bt[:, : case.block_table.shape[1]].copy_(case.block_table)
        decoder.plan_decode(case.seq_lens.cpu(), bt, 64, 16, 512, 64, case.scale, dtype, for_cudagraph=True)

    load(cases[0])
    decoder.run(q, cache, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, cache, out)
    for case in (cases[1], cases[0]):
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, case.reference())
        assert err < TOLERANCE[dtype], f"replay: rel error {err:.3e}"


@pytest.mark.parametrize("for_cudagraph", [False, True], ids=["eager", "graph-build"])
def test_backend_builder_and_impl(for_cudagraph: bool) -> None:
    """FLASHINFER_MLA through the MLA contract (builder plans, impl runs), with two
    CUDA-graph filler requests (seq_len 1) after the real ones."""
    from kvloom_backend_flashinfer import FlashInferMLABackend

    from kvloom.interfaces import AttentionLayerSpec, CommonAttentionMetadata, MLADims

    dtype = torch.bfloat16
    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    seq_lens = [3, 300, 2000]
    case = make_decode_case(seq_lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=32, dtype=dtype,
                            device="cuda", seed=11)
    spec = AttentionLayerSpec(
        num_heads=16, num_kv_heads=1, head_size=576, dtype=dtype, kv_cache_dtype=dtype, block_size=32,
        max_num_seqs=8, max_model_len=4096, scale=case.scale, extra={**dims.to_extra(), "mla_phase": "decode"},
    )
    lens = [*seq_lens, 1, 1]
    b = len(lens)
    block_table = torch.cat([case.block_table, case.block_table[:1].expand(2, -1)])
    qsl = torch.arange(b + 1, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), seq_lens=lens_t.cuda(), block_table=block_table,
        slot_mapping=torch.full((b,), -1, dtype=torch.int64, device="cuda"), num_reqs=b, num_actual_tokens=b,
        max_query_len=1, max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens_t,
    )
    builder = FlashInferMLABackend.get_builder_cls()(spec, torch.device("cuda"), block_table.shape[1])
    md = builder.build_for_cudagraph_capture(common) if for_cudagraph else builder.build(common)
    impl = FlashInferMLABackend.get_impl_cls()(dims, case.scale)
    q = torch.cat([case.q, case.q[:1].expand(2, -1, -1)])
    out = torch.full((b, 16, 512), float("nan"), dtype=dtype, device="cuda")
    impl.forward_decode(q, case.kv_cache, md, out)
    torch.cuda.synchronize()
    err = relative_error(out[: len(seq_lens)], case.reference())
    assert err < TOLERANCE[dtype], f"rel error {err:.3e}"
