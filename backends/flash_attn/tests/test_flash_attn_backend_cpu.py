"""CPU tests of the FLASH_ATTN backend (flash-attn itself needs CUDA and is not installed).

Covered without the library: the declarations and validation reasons (a missing flash-attn
is a reason naming the pip package; importing the backend does not import flash_attn),
the KV-cache write through the slot mapping (pure torch), the metadata builder
(``cu_seqlens_k``, kernel choice, CUDA-graph launch parameters and persistent buffers),
and the impl's call plumbing end to end: with the stand-in ``flash_attn`` of
``flash_attn_standin`` (float64, the library's signatures and argument rules) the backend
passes kvloom's conformance suite on the CPU and direct checks against the float64
reference of ``kvloom.testing.reference``. The real kernels are covered by
tests/test_flash_attn_backend_gpu.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import subprocess
import sys
from collections.abc import Iterator

import flash_attn_standin as standin
import pytest
import torch

standin.ensure_backend_importable()

from kvloom_backend_flash_attn import KVLOOM_PLUGIN_API, FlashAttentionBackend  # noqa: E402
from kvloom_backend_flash_attn.builder import (  # noqa: E402
    DECODE_KERNEL_ENV,
    DECODE_KERNEL_EXTRA_KEY,
    FlashAttentionMetadataBuilder,
)

from kvloom.interfaces import (  # noqa: E402
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    CommonAttentionMetadata,
    DeviceCapability,
    MultipleOf,
)
from kvloom.interfaces import write_kv_default_layout as write_kv_cache  # noqa: E402
from kvloom.testing import run_conformance  # noqa: E402
from kvloom.testing.reference import (  # noqa: E402
    PagedCache,
    PagedCase,
    PagedRun,
    check_paged_case,
    make_paged_case,
    place_requests,
    run_paged_case,
)

H100 = DeviceCapability(9, 0)


@pytest.fixture
def fake_flash_attn() -> Iterator[object]:
    with standin.installed() as module:
        yield module


def _config(**overrides) -> AttentionSelectorConfig:
    base = dict(head_size=128, dtype=torch.bfloat16, block_size=256, device_type="cuda", device_capability=H100,
                num_heads=32, num_kv_heads=8)
    base.update(overrides)
    return AttentionSelectorConfig(**base)


# ---------------------------------------------------------------------------- declarations
def test_declarations():
    assert KVLOOM_PLUGIN_API == "1.0"
    assert importlib.import_module("kvloom_backend_flash_attn.backend").KVLOOM_PLUGIN_API == "1.0"
    b = FlashAttentionBackend
    assert b.NAME == "FLASH_ATTN"
    assert b.supported_block_sizes == (MultipleOf(256),)
    assert b.cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert b.required_modules == {"flash_attn": "flash-attn"}
    assert b.support_summary() == {
        "dtypes": ["float16", "bfloat16"],
        "kv_cache_dtypes": ["auto"],
        "block_sizes": ["multiples of 256"],
        "head_sizes": "multiples of 8 up to 256",
        "device_types": ["cuda"],
        "compute_capability": ["8.0", None],
        "mla": False,
        "attention_types": ["decoder"],
        "cudagraph_support": "UNIFORM_BATCH",
        # window_size and softcap of both kernels; flash-attn 2 has no sinks.
        "sliding_window": True,
        "sinks": False,
        "logits_soft_cap": True,
    }
    # Block-size negotiation: the engine's default 16 is refused, so 256 is preferred.
    assert b.preferred_block_size(16) == 256
    assert [s for s in (16, 128, 256, 384, 512, 1024) if b.supports_block_size(s)] == [256, 512, 1024]


def test_kv_cache_shape_and_split_view():
    shape = FlashAttentionBackend.get_kv_cache_shape(3, 256, 2, 64)
    assert shape == (2, 3, 256, 2, 64)
    cache = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    k, v = FlashAttentionBackend.split_kv_cache(cache)
    assert k.shape == v.shape == (3, 256, 2, 64)
    assert torch.equal(k[2, 7], cache[0, 2, 7]) and torch.equal(v[2, 7], cache[1, 2, 7])


def test_missing_flash_attn_is_a_reason_naming_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "flash_attn" else real(name, *a, **k)
    )
    assert FlashAttentionBackend.validate_configuration(_config()) == [
        "flash_attn is not installed (pip install flash-attn)"
    ]


def test_importing_the_backend_does_not_import_flash_attn():
    # A fresh interpreter, so no other test's stand-in interferes.
    code = (
        "import sys; sys.path.insert(0, %r); import kvloom_backend_flash_attn as m; "
        "m.FlashAttentionBackend.validate_configuration; m.FlashAttentionBackend.get_builder_cls(); "
        "print('flash_attn' in sys.modules)"
    ) % str(standin.BACKEND_SRC)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_impl_without_the_cuda_extension_is_a_clear_import_error():
    with standin.installed(with_kernels=False):
        with pytest.raises(ImportError, match=r"FLASH_ATTN needs flash-attn 2 with its CUDA extension"):
            FlashAttentionBackend.get_impl_cls()


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(block_size=16), "block size 16 not supported (supports multiples of 256)"),
        (dict(block_size=128), "block size 128 not supported (supports multiples of 256)"),
        (dict(block_size=320), "block size 320 not supported (supports multiples of 256)"),
        (dict(dtype=torch.float32), "dtype float32 not supported (supports float16, bfloat16)"),
        (dict(head_size=100), "head size 100 not supported (supports multiples of 8 up to 256)"),
        (dict(head_size=512), "head size 512 not supported (supports multiples of 8 up to 256)"),
        (dict(kv_cache_dtype="fp8"), "kv cache dtype fp8 not supported (supports auto)"),
        (dict(device_type="cpu", device_capability=None), "device type cpu not supported (supports cuda)"),
        (dict(device_capability=DeviceCapability(7, 5)), "compute capability 7.5 not supported (supports 8.0..any)"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type encoder_only not supported (supports decoder)"),
        (dict(use_mla=True), "MLA not supported"),
    ],
)
def test_validation_reasons(fake_flash_attn, overrides, reason):
    assert FlashAttentionBackend.validate_configuration(_config(**overrides)) == [reason]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(block_size=None),  # no user block size: no block-size reason (the backend decides)
        dict(block_size=512, dtype=torch.float16),
        dict(head_size=64, device_capability=DeviceCapability(8, 0)),
        dict(head_size=80),
        dict(head_size=256, device_capability=DeviceCapability(10, 0)),
        dict(head_size=8),
    ],
)
def test_valid_configurations(fake_flash_attn, overrides):
    assert FlashAttentionBackend.validate_configuration(_config(**overrides)) == []


# ---------------------------------------------------------------------------- KV write
def _reference_write(cache: torch.Tensor, key, value, slots) -> torch.Tensor:
    expected = cache.clone()
    bs = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[0, s // bs, s % bs] = key[t]
            expected[1, s // bs, s % bs] = value[t]
    return expected


@pytest.mark.parametrize(
    "slots",
    [
        [3 * 256 + 5, -1, 0, 256 + 255, 512, -1],  # across blocks, with padding in between
        [-1, -1, 700, 701],  # the first entries are padding
        [-1, -1, -1],  # nothing to write (a warm-up step): the cache stays as it was
        [0],  # slot 0 itself
    ],
)
def test_write_kv_cache_matches_a_loop_and_skips_minus_one(slots):
    gen = torch.Generator().manual_seed(len(slots))
    cache = torch.randn(FlashAttentionBackend.get_kv_cache_shape(4, 256, 2, 16), generator=gen).to(torch.bfloat16)
    # key/value as views of a fused projection with extra rows past the slot mapping.
    qkv = torch.randn(len(slots) + 2, 3 * 2 * 16, generator=gen).to(torch.bfloat16)
    key = qkv[:, 32:64].view(-1, 2, 16)
    value = qkv[:, 64:].view(-1, 2, 16)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = _reference_write(cache, key, value, slot_mapping)
    write_kv_cache(cache, key, value, slot_mapping)
    assert torch.equal(cache, expected)


def test_write_kv_cache_rejects_other_layouts():
    with pytest.raises(ValueError, match=r"must be shaped \(2, num_blocks, block_size"):
        write_kv_cache(torch.zeros(4, 2, 256, 2, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), torch.tensor([0]))


# ---------------------------------------------------------------------------- the builder
HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS, WIDTH = 8, 2, 64, 256, 16, 4
SCALE = 1 / math.sqrt(DIM)


def _spec(max_num_seqs: int = 8, extra: dict | None = None, dtype=torch.bfloat16) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=dtype,
                              kv_cache_dtype=dtype, block_size=BLOCK, max_num_seqs=max_num_seqs,
                              max_model_len=WIDTH * BLOCK, scale=SCALE, extra=extra or {})


def _common(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor | None = None,
            pad_tokens: int = 0) -> CommonAttentionMetadata:
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    if block_table is None:
        block_table = torch.arange(len(seq_lens) * WIDTH, dtype=torch.int32).view(-1, WIDTH) % NUM_BLOCKS
    n = sum(query_lens) + pad_tokens
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=sl, block_table=block_table, slot_mapping=torch.full((n,), -1),
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl.clone(), seq_lens_cpu=sl.clone(),
    )


def test_builder_mixed_batch_metadata():
    builder = FlashAttentionMetadataBuilder(_spec(), torch.device("cpu"), WIDTH)
    md = builder.build(_common([5, 1, 300], [5, 700, 812], pad_tokens=3))
    assert not md.decode_with_kvcache
    assert md.cu_seqlens_k.dtype == torch.int32 and md.cu_seqlens_k.tolist() == [0, 5, 705, 1517]
    assert (md.num_query_rows, md.max_query_len, md.max_seq_len, md.num_actual_tokens) == (306, 300, 812, 306)


def test_builder_decode_kernel_switch(monkeypatch):
    decode = _common([1, 1, 1], [40, 256, 1000])
    monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    default = FlashAttentionMetadataBuilder(_spec(), torch.device("cpu"), WIDTH).build(decode)
    assert default.decode_with_kvcache and default.cu_seqlens_k is None  # no cumsum needed
    by_extra = FlashAttentionMetadataBuilder(_spec(extra={DECODE_KERNEL_EXTRA_KEY: "varlen"}), "cpu", WIDTH)
    md = by_extra.build(decode)
    assert not md.decode_with_kvcache and md.cu_seqlens_k.tolist() == [0, 40, 296, 1296]
    monkeypatch.setenv(DECODE_KERNEL_ENV, "varlen")
    assert not FlashAttentionMetadataBuilder(_spec(), "cpu", WIDTH).build(decode).decode_with_kvcache
    # spec.extra wins over the environment.
    by_both = FlashAttentionMetadataBuilder(_spec(extra={DECODE_KERNEL_EXTRA_KEY: "kvcache"}), "cpu", WIDTH)
    assert by_both.build(decode).decode_with_kvcache
    monkeypatch.setenv(DECODE_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=f"{DECODE_KERNEL_ENV}: 'fast' is not a FLASH_ATTN decode kernel "
                                         r"\(allowed: kvcache, varlen\)"):
        FlashAttentionMetadataBuilder(_spec(), "cpu", WIDTH)


@pytest.mark.parametrize("kernel", ["kvcache", "varlen"])
def test_builder_cudagraph_launch_parameters_depend_only_on_the_batch_shape(kernel):
    builder = FlashAttentionMetadataBuilder(_spec(extra={DECODE_KERNEL_EXTRA_KEY: kernel}), "cpu", WIDTH)
    # The runner's persistent buffers, refilled in place between replays.
    common = _common([1] * 4, [1, 1, 1, 1])
    first = builder.build_for_cudagraph_capture(common)
    common.seq_lens.copy_(torch.tensor([900, 3, 256, 1]))
    common.seq_lens_cpu.copy_(common.seq_lens)
    common.max_seq_len = 900
    second = builder.build_for_cudagraph_capture(common)
    for md in (first, second):
        assert (md.num_reqs, md.num_query_rows, md.max_query_len) == (4, 4, 1)
        assert md.max_seq_len == WIDTH * BLOCK  # max_model_len, not this step's longest
        assert md.seq_lens.data_ptr() == common.seq_lens.data_ptr()
        assert md.block_table.data_ptr() == common.block_table.data_ptr()
    if kernel == "varlen":
        assert first.cu_seqlens_k.data_ptr() == second.cu_seqlens_k.data_ptr()  # one persistent buffer
        assert second.cu_seqlens_k.tolist() == [0, 900, 903, 1159, 1160]
    else:
        assert first.cu_seqlens_k is None and second.cu_seqlens_k is None


def test_builder_cudagraph_refuses_non_uniform_and_oversized_batches():
    builder = FlashAttentionMetadataBuilder(_spec(max_num_seqs=4), "cpu", WIDTH)
    with pytest.raises(ValueError, match=r"uniform batches .* got query lengths \[1, 3\]"):
        builder.build_for_cudagraph_capture(_common([1, 3], [10, 20]))
    uniform = builder.build_for_cudagraph_capture(_common([2, 2], [10, 20]))  # UNIFORM_BATCH: q_len 2 is fine
    assert (uniform.num_query_rows, uniform.max_query_len, uniform.decode_with_kvcache) == (4, 2, False)
    with pytest.raises(ValueError, match=r"CUDA-graph batch size 5 out of range 1..4"):
        builder.build_for_cudagraph_capture(_common([1] * 5, [3] * 5))


# ---------------------------------------------------------------------------- impl plumbing
def test_conformance_suite_through_the_standin(fake_flash_attn, monkeypatch):
    """kvloom's whole conformance suite (block sizes 256 and 512, fp16/bf16, GQA/MQA, head
    sizes, padding, CUDA-graph fillers) on the CPU, with the stand-in computing the kernels:
    this checks the backend's KV write, metadata and argument plumbing, not flash-attn."""
    monkeypatch.setattr(FlashAttentionBackend, "supported_device_types", ("cuda", "cpu"))
    report = run_conformance(FlashAttentionBackend, device="cpu", seed=1234)
    assert report.passed, report.format()
    assert {c.params["block_size"] for c in report.ran} == {256, 512}
    # The declared window and soft cap ran (NaN in the blocks before each window).
    assert {"sliding_window", "sliding_window_long_decode", "soft_cap"} <= {c.params["scenario"] for c in report.ran}
    kernels = {call["kernel"] for call in standin.calls}
    assert kernels == {"varlen", "kvcache"}


def _case(requests, kernel: str, seed: int) -> PagedCase:
    """One step of ``(context_len, query_len)`` requests on shuffled blocks of a fresh bf16
    cache, with the pure-decode kernel ``kernel``."""
    spec = _spec(extra={DECODE_KERNEL_EXTRA_KEY: kernel})
    return make_paged_case(
        FlashAttentionBackend, [q for _, q in requests], [c + q for c, q in requests], num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_size=DIM, block_size=BLOCK, dtype=spec.dtype, seed=seed,
        max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, extra=spec.extra,
    )


@pytest.mark.parametrize("kernel", ["kvcache", "varlen"])
@pytest.mark.parametrize(
    "requests",
    [
        [(300, 1), (0, 1), (511, 1), (700, 1)],  # pure decode (kernel switch applies)
        [(0, 37), (255, 2), (600, 1), (10, 300)],  # prefill, chunk over a cached prefix, decode
    ],
)
def test_impl_forward_matches_reference(fake_flash_attn, kernel, requests):
    case = _case(requests, kernel, seed=len(requests) * 7 + len(kernel))
    run = run_paged_case(case)
    check = check_paged_case(case, run)
    assert run.returned is run.output and not check.problems, check.problems
    assert check.rel_error < 1e-2, check
    (call,) = standin.calls
    decode = all(qlen == 1 for _, qlen in requests)
    assert call["kernel"] == ("kvcache" if decode and kernel == "kvcache" else "varlen")
    assert call["softmax_scale"] == SCALE and call["causal"] is True
    if call["kernel"] == "varlen":
        assert call["max_seqlen_k"] == max(c + q for c, q in requests)


@pytest.mark.parametrize("kernel", ["kvcache", "varlen"])
def test_window_and_soft_cap_reach_the_kernels(fake_flash_attn, kernel):
    """A layer's window W is flash-attn's ``window_size=(W - 1, 0)`` and its cap ``softcap``,
    for both kernels; the conformance suite (above) checks the results against float64."""
    spec = _spec(extra={DECODE_KERNEL_EXTRA_KEY: kernel})
    gen = torch.Generator().manual_seed(9)
    cache = PagedCache.allocate(FlashAttentionBackend, spec, NUM_BLOCKS, "cpu", gen)
    builder = cache.make_builder(WIDTH)
    impl = FlashAttentionBackend.get_impl_cls()(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS,
                                               sliding_window=300, logits_soft_cap=30.0)  # fmt: skip
    step = cache.step(place_requests([1, 1], [700, 40], block_size=BLOCK, num_blocks=NUM_BLOCKS, generator=gen))
    out = torch.empty_like(step.query)
    impl.forward(step.query, step.key, step.value, cache.kv_cache, builder.build(step.common), out)
    (call,) = standin.calls
    assert call["kernel"] == kernel and call["window_size"] == (299, 0) and call["softcap"] == 30.0


def test_impl_cudagraph_style_replay_with_fillers(fake_flash_attn):
    """A padded decode batch built for capture; then another step over the same cache
    copied into its tensors in place and built again (what the runner does before a
    replay): correct for the real requests both times, with the launch parameters of the
    first build."""
    gen = torch.Generator().manual_seed(5)
    cache = PagedCache.allocate(FlashAttentionBackend, _spec(extra={DECODE_KERNEL_EXTRA_KEY: "varlen"}), NUM_BLOCKS,
                                "cpu", gen, fill="nan")
    builder, impl = cache.make_builder(WIDTH), cache.make_impl()
    captured = first_md = None
    for seq_lens in ([101, 4], [901, 258]):
        requests = place_requests([1, 1], seq_lens, block_size=BLOCK, num_blocks=NUM_BLOCKS, generator=gen)
        step = cache.step(requests, filler_requests=2, max_blocks=WIDTH)
        if captured is None:
            captured = step  # the persistent buffers a graph is captured on
        else:
            captured.refill_from(step)
        md = builder.build_for_cudagraph_capture(captured.common)
        if first_md is None:
            first_md = md
        launch = (md.num_reqs, md.num_query_rows, md.max_query_len, md.max_seq_len)
        assert launch == (first_md.num_reqs, first_md.num_query_rows, first_md.max_query_len, first_md.max_seq_len)
        assert md.cu_seqlens_k.data_ptr() == first_md.cu_seqlens_k.data_ptr()
        out = torch.full_like(captured.query, float("nan"))
        impl.forward(captured.query, captured.key, captured.value, cache.kv_cache, md, out)
        # The cache exactly: the two real tokens' K/V written, the fillers' slot -1 skipped.
        check = check_paged_case(step, PagedRun(out, md, None))
        assert not check.problems, check.problems
        assert check.rel_error < 1e-2, check
        assert (md.num_query_rows, md.max_seq_len) == (4, WIDTH * BLOCK)
        assert standin.calls[-1]["max_seqlen_k"] == WIDTH * BLOCK


def test_impl_rejects_unsupported_features(fake_flash_attn):
    impl_cls = FlashAttentionBackend.get_impl_cls()
    with pytest.raises(NotImplementedError, match="attention sinks not supported"):
        impl_cls(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2, sinks=torch.zeros(8))
    with pytest.raises(NotImplementedError, match="attn_type encoder_only not supported"):
        impl_cls(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2, attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype fp8 not supported"):
        impl_cls(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2, kv_cache_dtype="fp8")


def test_benchmark_script_runs_flash_attn_with_both_decode_kernels(tmp_path):
    """benchmarks/bench_attention_kernels.py with FLASH_ATTN (stand-in kernels, CPU smoke
    mode), so the GPU run cannot fail on a script error: FLASH_ATTN gets its preferred
    block size 256 and one row per decode kernel."""
    import json
    import os
    from pathlib import Path

    here = Path(__file__).resolve().parent
    root = here.parents[2]
    code = f"""
import runpy, sys
sys.path[:0] = [{str(here)!r}]
import flash_attn_standin as standin
standin.ensure_backend_importable()
from kvloom.testing import installed_backend
from kvloom_backend_flash_attn import FlashAttentionBackend
with standin.installed(), installed_backend(FlashAttentionBackend):
    sys.argv = ["bench", "--device", "cpu", "--dtype", "float16", "--num-heads", "4", "--num-kv-heads", "2",
                "--head-size", "32", "--decode-batch", "2", "--decode-context", "300", "--prefill-batch", "1",
                "--prefill-len", "32", "--copy-gib", "0.001", "--gemm-n", "64", "--backends", "FLASH_ATTN",
                "--out", {str(tmp_path)!r}]
    runpy.run_path({str(root / "benchmarks" / "bench_attention_kernels.py")!r}, run_name="__main__")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = json.loads((tmp_path / "attention_kernels.json").read_text())["rows"]
    assert [(r["backend"], r["variant"], r["block_size"]) for r in rows] == [
        ("FLASH_ATTN", "decode=kvcache", 256), ("FLASH_ATTN", "decode=varlen", 256)
    ]
    for row in rows:
        assert "error" not in row, row["error"]
        assert max(row["rel_errors"].values()) < 5e-3
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0
