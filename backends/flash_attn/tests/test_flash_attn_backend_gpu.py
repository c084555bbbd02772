"""GPU tests of the FLASH_ATTN backend (skipped without CUDA or without flash_attn).

1. kvloom's conformance suite (block sizes 256 and 512, fp16/bf16, GQA/MQA, head sizes
   64/128/256/80, padding, CUDA-graph fillers) with each pure-decode kernel.
2. A CUDA graph of a padded decode step: captured once, then replayed for new steps
   whose lengths, block tables, slots and data were refilled in place (after the builder
   refreshed its persistent state, as the model runner does), against float64 and eager.
3. Selection on the real device: ``kvloom backends --json`` selects FLASH_ATTN with block
   size 256 (Ampere/Hopper, where FLASH_ATTN is first in priority); with ``--block-size
   16`` it does not, and shows the reason; the engine config agrees.

Needs flash-attn (see shared/gpu/flash-attn/README.md for the build) and the backend's
distribution installed for its entry point: ``pip install --no-deps -e backends/flash_attn``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("flash_attn", reason="needs flash-attn (shared/gpu/flash-attn/README.md)")

from kvloom import plugins  # noqa: E402
from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata  # noqa: E402

BLOCK_16_REASON = "block size 16 not supported (supports multiples of 256)"
HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS, WIDTH = 16, 4, 128, 256, 64, 8
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(DIM)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    for var in ("KVLOOM_PLUGINS", "KVLOOM_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()


def _backend():
    backends = plugins.attention_backends()
    assert "FLASH_ATTN" in backends, (
        "kvloom-backend-flash-attn is not installed: pip install --no-deps -e backends/flash_attn"
    )
    return backends["FLASH_ATTN"].target


def _hopper_or_ampere() -> bool:
    return torch.cuda.get_device_capability()[0] in (8, 9)


# ---------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("decode_kernel", ["kvcache", "varlen"])
def test_conformance_suite(decode_kernel, monkeypatch):
    from kvloom.testing import run_conformance
    from kvloom_backend_flash_attn.metadata import DECODE_KERNEL_ENV

    _backend()
    monkeypatch.setenv(DECODE_KERNEL_ENV, decode_kernel)
    report = run_conformance("FLASH_ATTN", device="cuda", quick=decode_kernel == "varlen")
    assert report.passed, report.format()
    assert {256, 512} <= {c.params["block_size"] for c in report.ran}, report.format()


# ---------------------------------------------------------------------------- CUDA graphs
class DecodeBuffers:
    """A model runner's persistent decode inputs for one padded batch size."""

    def __init__(self, size: int) -> None:
        dev = "cuda"
        self.size = size
        self.query_start_loc_cpu = torch.arange(size + 1, dtype=torch.int32)
        self.seq_lens_cpu = torch.ones(size, dtype=torch.int32)
        self.query_start_loc = self.query_start_loc_cpu.to(dev)
        self.seq_lens = self.seq_lens_cpu.to(dev)
        self.block_table = torch.zeros(size, WIDTH, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.q = torch.zeros(size, HEADS, DIM, dtype=DTYPE, device=dev)
        self.k = torch.zeros(size, KV_HEADS, DIM, dtype=DTYPE, device=dev)
        self.v = torch.zeros(size, KV_HEADS, DIM, dtype=DTYPE, device=dev)
        self.out = torch.zeros(size, HEADS, DIM, dtype=DTYPE, device=dev)

    def fill(self, seq_lens: list[int], gen: torch.Generator) -> None:
        """A decode step of ``len(seq_lens)`` real requests (each on distinct random blocks),
        padded with fillers (seq_len 1, block-table row 0, slot -1), written in place."""
        real = len(seq_lens)
        lens = seq_lens + [1] * (self.size - real)
        table = torch.zeros(self.size, WIDTH, dtype=torch.int32)
        perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        slots = [-1] * self.size
        for i, s in enumerate(seq_lens):
            n = -(-s // BLOCK)
            table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
            slots[i] = int(table[i, (s - 1) // BLOCK]) * BLOCK + (s - 1) % BLOCK
        self.seq_lens_cpu.copy_(torch.tensor(lens, dtype=torch.int32))
        self.seq_lens.copy_(self.seq_lens_cpu)
        self.block_table.copy_(table)
        self.slot_mapping.copy_(torch.tensor(slots))
        for t in (self.q, self.k, self.v):
            t.copy_(torch.randn(t.shape, generator=gen).to(DTYPE))

    def common(self) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            slot_mapping=self.slot_mapping, num_reqs=self.size, num_actual_tokens=self.size, max_query_len=1,
            max_seq_len=int(self.seq_lens_cpu.max()), query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
        )

    def reference(self, cache: torch.Tensor, real: int) -> torch.Tensor:
        """float64 decode attention of the real requests over the cache (new token included)."""
        k_cache, v_cache = cache[0].cpu(), cache[1].cpu()
        outs = []
        for i in range(real):
            s = int(self.seq_lens_cpu[i])
            pos = torch.arange(s)
            blocks = self.block_table[i].cpu().long()[pos // BLOCK]
            keys = k_cache[blocks, pos % BLOCK].double().repeat_interleave(HEADS // KV_HEADS, 1)
            values = v_cache[blocks, pos % BLOCK].double().repeat_interleave(HEADS // KV_HEADS, 1)
            scores = torch.einsum("hd,khd->hk", self.q[i].cpu().double(), keys) * SCALE
            outs.append(torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values))
        return torch.stack(outs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("decode_kernel", ["kvcache", "varlen"])
def test_cudagraph_capture_and_replay_of_a_padded_decode_step(decode_kernel):
    from kvloom_backend_flash_attn.metadata import DECODE_KERNEL_EXTRA_KEY

    backend = _backend()
    spec = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=DTYPE,
                              kv_cache_dtype=DTYPE, block_size=BLOCK, max_num_seqs=16, max_model_len=WIDTH * BLOCK,
                              scale=SCALE, extra={DECODE_KERNEL_EXTRA_KEY: decode_kernel})
    builder = backend.get_builder_cls()(spec, torch.device("cuda"), WIDTH)
    impl = backend.get_impl_cls()(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS)
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, KV_HEADS, DIM), generator=gen).to(DTYPE).cuda()
    buffers = DecodeBuffers(size=8)

    # Capture with a dummy step (all fillers), after eager warm-up on a side stream.
    captured = builder.build_for_cudagraph_capture(buffers.common())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            impl.forward(buffers.q, buffers.k, buffers.v, cache, captured, buffers.out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(buffers.q, buffers.k, buffers.v, cache, captured, buffers.out)

    # Steps of 5 and 3 real requests, short and long (up to max_model_len), replayed.
    for lens in ([300, 1, 2048, 513, 256], [WIDTH * BLOCK, 7, 1000]):
        buffers.fill(lens, gen)
        refreshed = builder.build_for_cudagraph_capture(buffers.common())
        launch = lambda m: (m.num_reqs, m.num_query_rows, m.max_query_len, m.max_seq_len)  # noqa: E731
        assert launch(refreshed) == launch(captured) == (8, 8, 1, WIDTH * BLOCK)
        before = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        real = len(lens)
        assert _rel_err(buffers.out[:real], buffers.reference(cache, real)) < 2e-2
        # Exactly the real requests' new K/V were written; fillers (slot -1) wrote nothing.
        changed = (cache != before).flatten(3).any(-1)
        assert int(changed[0].sum()) == real and int(changed[1].sum()) == real
        slots = buffers.slot_mapping[:real]
        assert torch.equal(cache[0][slots // BLOCK, slots % BLOCK], buffers.k[:real])
        # The replay equals an eager step on the same inputs.
        eager_out = torch.empty_like(buffers.out)
        impl.forward(buffers.q, buffers.k, buffers.v, before, builder.build(buffers.common()), eager_out)
        assert _rel_err(buffers.out[:real], eager_out[:real].double().cpu()) < 1e-2


# ---------------------------------------------------------------------------- selection
def test_kvloom_backends_selects_flash_attn_with_block_size_256(capsys):
    from kvloom.entrypoints.cli.main import main

    _backend()
    if not _hopper_or_ampere():
        pytest.skip("FLASH_ATTN is first in priority on SM 8.x/9.x only")
    assert main(["backends", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["platform"] == "cuda"
    assert (report["selected"], report["block_size"]) == ("FLASH_ATTN", 256), report

    assert main(["backends", "--json", "--block-size", "16"]) == 0
    forced = json.loads(capsys.readouterr().out)
    flash = next(c for c in forced["candidates"] if c["name"] == "FLASH_ATTN")
    assert flash["reasons"] == [BLOCK_16_REASON] and not flash["valid"]
    assert forced["selected"] not in (None, "FLASH_ATTN") and forced["block_size"] == 16

    main(["backends", "--block-size", "16"])
    table = capsys.readouterr().out
    assert "block size 16 not supported" in table and "(supports multiples of 256)" in table


def test_engine_config_on_the_device_uses_flash_attn_and_block_size_256(tmp_path):
    repo = str(Path(__file__).resolve().parents[3])  # for tests.helpers
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tests.helpers.model_fixtures import make_tiny_model

    from kvloom.engine.arg_utils import EngineArgs
    from kvloom.engine.arg_utils import create_engine_config

    _backend()
    if not _hopper_or_ampere():
        pytest.skip("FLASH_ATTN is first in priority on SM 8.x/9.x only")
    model = make_tiny_model("qwen3", tmp_path / "qwen3", max_position_embeddings=2048)
    config = create_engine_config(EngineArgs(model=str(model), dtype="bfloat16"))
    assert (config.attention.backend.NAME, config.cache.block_size) == ("FLASH_ATTN", 256)
    forced = create_engine_config(EngineArgs(model=str(model), dtype="bfloat16", block_size=16))
    assert forced.attention.backend.NAME != "FLASH_ATTN" and forced.cache.block_size == 16
