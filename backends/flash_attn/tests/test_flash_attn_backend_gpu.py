"""GPU tests of the FLASH_ATTN backend (skipped without CUDA or without flash_attn).

1. kvloom's conformance suite (block sizes 256 and 512, fp16/bf16, GQA/MQA, head sizes
   64/128/256/80, padding, CUDA-graph fillers) with each pure-decode kernel.
2. A CUDA graph of a padded decode step: captured once, then replayed for new steps
   whose lengths, block tables, slots and data were refilled in place (after the builder
   refreshed its persistent state, as the model runner does), against the float64
   reference of ``kvloom.testing.reference`` and an eager step.
3. Selection on the real device: ``kvloom backends --json`` selects FLASH_ATTN with block
   size 256 (Ampere/Hopper, where FLASH_ATTN is first in priority); with ``--block-size
   16`` it does not, and shows the reason; the engine config agrees.

Needs flash-attn, which is built on the GPU machine: ``bash tests/gpu/run.sh fa-start fa-wait``
builds its wheel from the carried sdist (``.fa/``; about 22 minutes, so call ``fa-wait``
again on the same warm machine until it is installed), or ``bash tests/gpu/run.sh
fa-install`` installs a wheel built earlier and carried in ``.fawhl/`` (see the header of
tests/gpu/run.sh). And the backend's distribution installed for its entry point (run.sh's
setup stage does it): ``pip install --no-deps -e backends/flash_attn``.
"""

from __future__ import annotations

import json
import math
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip(
    "flash_attn", reason="needs flash-attn: bash tests/gpu/run.sh fa-start fa-wait (or fa-install a carried wheel)"
)

from kvloom.interfaces import AttentionLayerSpec  # noqa: E402
from kvloom.testing import fresh_plugins, resolve_engine_config, run_cli, run_conformance  # noqa: E402
from kvloom.testing.reference import (  # noqa: E402
    PagedCache,
    PagedRun,
    check_paged_case,
    place_requests,
    relative_error,
)

BLOCK_16_REASON = "block size 16 not supported (supports multiples of 256)"
HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS, WIDTH = 16, 4, 128, 256, 64, 8
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(DIM)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    for var in ("KVLOOM_PLUGINS", "KVLOOM_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    with fresh_plugins():
        yield


def _backend():
    backends = {ep.name: ep for ep in entry_points(group="kvloom.attention_backends")}
    assert "FLASH_ATTN" in backends, (
        "kvloom-backend-flash-attn is not installed: pip install --no-deps -e backends/flash_attn"
    )
    return backends["FLASH_ATTN"].load()


def _hopper_or_ampere() -> bool:
    return torch.cuda.get_device_capability()[0] in (8, 9)


# ---------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("decode_kernel", ["kvcache", "varlen"])
def test_conformance_suite(decode_kernel, monkeypatch):
    from kvloom_backend_flash_attn.builder import DECODE_KERNEL_ENV

    _backend()
    monkeypatch.setenv(DECODE_KERNEL_ENV, decode_kernel)
    report = run_conformance("FLASH_ATTN", device="cuda", quick=decode_kernel == "varlen")
    assert report.passed, report.format()
    assert {256, 512} <= {c.params["block_size"] for c in report.ran}, report.format()


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("decode_kernel", ["kvcache", "varlen"])
def test_cudagraph_capture_and_replay_of_a_padded_decode_step(decode_kernel):
    from kvloom_backend_flash_attn.builder import DECODE_KERNEL_EXTRA_KEY

    backend = _backend()
    spec = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=DTYPE,
                              kv_cache_dtype=DTYPE, block_size=BLOCK, max_num_seqs=16, max_model_len=WIDTH * BLOCK,
                              scale=SCALE, extra={DECODE_KERNEL_EXTRA_KEY: decode_kernel})
    gen = torch.Generator().manual_seed(11)
    cache = PagedCache.allocate(backend, spec, NUM_BLOCKS, "cuda", gen, fill="random")
    builder, impl = cache.make_builder(WIDTH), cache.make_impl()
    # A model runner's persistent decode inputs for batch size 8, holding a dummy step of
    # filler requests alone (seq_len 1, block-table row 0, slot -1) to capture with.
    buffers = cache.step([], filler_requests=8, max_blocks=WIDTH)
    out = torch.zeros_like(buffers.query)

    # Capture with the dummy step, after eager warm-up on a side stream.
    captured = builder.build_for_cudagraph_capture(buffers.common)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            impl.forward(buffers.query, buffers.key, buffers.value, cache.kv_cache, captured, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(buffers.query, buffers.key, buffers.value, cache.kv_cache, captured, out)

    # Steps of 5 and 3 real requests (each on distinct random blocks), short and long (up to
    # max_model_len), padded with fillers, written into the buffers in place and replayed.
    for lens in ([300, 1, 2048, 513, 256], [WIDTH * BLOCK, 7, 1000]):
        real = len(lens)
        requests = place_requests([1] * real, lens, block_size=BLOCK, num_blocks=NUM_BLOCKS, generator=gen)
        step = cache.step(requests, filler_requests=8 - real, max_blocks=WIDTH)
        buffers.refill_from(step)
        refreshed = builder.build_for_cudagraph_capture(buffers.common)
        launch = lambda m: (m.num_reqs, m.num_query_rows, m.max_query_len, m.max_seq_len)  # noqa: E731
        assert launch(refreshed) == launch(captured) == (8, 8, 1, WIDTH * BLOCK)
        before = cache.kv_cache.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # Against the float64 reference; and the cache exactly: the real requests' new K/V
        # at their slots, nothing else written (the fillers' slot -1 included).
        check = check_paged_case(step, PagedRun(out, refreshed, None))
        assert not check.problems, check.problems
        assert check.rel_error < 2e-2, check
        # The replay equals an eager step on the same inputs.
        eager_out = torch.empty_like(out)
        impl.forward(step.query, step.key, step.value, before, builder.build(step.common), eager_out)
        assert relative_error(out[:real], eager_out[:real]) < 1e-2


# ---------------------------------------------------------------------------- selection
def test_kvloom_backends_selects_flash_attn_with_block_size_256(capsys):
    _backend()
    if not _hopper_or_ampere():
        pytest.skip("FLASH_ATTN is first in priority on SM 8.x/9.x only")
    assert run_cli(["backends", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["platform"] == "cuda"
    assert (report["selected"], report["block_size"]) == ("FLASH_ATTN", 256), report

    assert run_cli(["backends", "--json", "--block-size", "16"]) == 0
    forced = json.loads(capsys.readouterr().out)
    flash = next(c for c in forced["candidates"] if c["name"] == "FLASH_ATTN")
    assert flash["reasons"] == [BLOCK_16_REASON] and not flash["valid"]
    assert forced["selected"] not in (None, "FLASH_ATTN") and forced["block_size"] == 16

    run_cli(["backends", "--block-size", "16"])
    table = capsys.readouterr().out
    assert "block size 16 not supported" in table and "(supports multiples of 256)" in table


def test_engine_config_on_the_device_uses_flash_attn_and_block_size_256(tmp_path):
    repo = str(Path(__file__).resolve().parents[3])  # for tests.helpers
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tests.helpers.model_fixtures import make_tiny_model

    _backend()
    if not _hopper_or_ampere():
        pytest.skip("FLASH_ATTN is first in priority on SM 8.x/9.x only")
    model = make_tiny_model("qwen3", tmp_path / "qwen3", max_position_embeddings=2048)
    config = resolve_engine_config(model=str(model), dtype="bfloat16")
    assert (config.attention.backend.NAME, config.cache.block_size) == ("FLASH_ATTN", 256)
    forced = resolve_engine_config(model=str(model), dtype="bfloat16", block_size=16)
    assert forced.attention.backend.NAME != "FLASH_ATTN" and forced.cache.block_size == 16
