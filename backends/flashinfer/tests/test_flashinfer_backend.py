"""CPU tests of the FLASHINFER backend (flashinfer itself is not installed here).

Covered without the library: the support declarations and validation reasons (a missing
flashinfer is a reason naming the pip package, and importing the backend does not import
flashinfer), the host-side CSR planning arrays against hand-computed values, the KV-cache
write through the slot mapping, and the builder/impl plumbing end to end against the float64
reference of ``kvloom.testing.reference``. For the latter a small stand-in for the
``flashinfer`` module is installed in ``sys.modules``: it implements the two wrappers' 0.7
``__init__``/``plan``/``run`` signatures used by the backend, computing attention from the
planned CSR arrays exactly as FlashInfer defines them (for CUDA-graph wrappers, reading them
back from the persistent buffers). The reference reads the cache through the block tables,
not the CSR arrays, so the tests check the backend's planning, wrapper choice, buffer wiring
and cache writes; the real kernels are covered by the GPU conformance run
(tests/gpu/test_backends_fiflex.py).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

try:
    import kvloom_backend_flashinfer  # noqa: F401
except ImportError:  # the venv script skips installing this package: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom_backend_flashinfer import KVLOOM_PLUGIN_API, FlashInferBackend
from kvloom_backend_flashinfer.kv_write import copy_rows_skipping_invalid, write_kv_nhd_paired
from kvloom_backend_flashinfer.planning import gather_kv_indices, plan_paged_kv

from kvloom.interfaces import (
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    DeviceCapability,
)
from kvloom.testing.reference import PagedCase, PagedRun, check_paged_case, make_paged_case, run_paged_case

H100 = DeviceCapability(9, 0)


def _config(**overrides) -> AttentionSelectorConfig:
    base = dict(
        head_size=128,
        dtype=torch.bfloat16,
        block_size=16,
        device_type="cuda",
        device_capability=H100,
        num_heads=8,
        num_kv_heads=2,
    )
    base.update(overrides)
    return AttentionSelectorConfig(**base)


# ---------------------------------------------------------------------------- declarations
def test_module_declares_plugin_api_and_name():
    assert KVLOOM_PLUGIN_API == "1.0"
    assert importlib.import_module("kvloom_backend_flashinfer.backend").KVLOOM_PLUGIN_API == "1.0"
    assert FlashInferBackend.NAME == "FLASHINFER"
    assert FlashInferBackend.cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    summary = FlashInferBackend.support_summary()
    assert summary["dtypes"] == ["float16", "bfloat16"]
    assert summary["block_sizes"] == ["16", "32", "64"]
    assert summary["head_sizes"] == [64, 128, 256]
    assert summary["compute_capability"] == ["7.5", "12.1"]
    assert FlashInferBackend.preferred_block_size() == 16


def test_missing_flashinfer_is_a_reason_naming_the_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("flashinfer"))
    assert FlashInferBackend.validate_configuration(_config()) == [
        "flashinfer is not installed (pip install flashinfer-python)"
    ]


def test_importing_the_backend_does_not_import_flashinfer():
    # Run in a fresh interpreter so no other test's stand-in module interferes.
    code = (
        "import sys; sys.path.insert(0, %r); import kvloom_backend_flashinfer as m; "
        "m.FlashInferBackend.validate_configuration; m.FlashInferBackend.get_impl_cls(); "
        "print('flashinfer' in sys.modules)"
    ) % str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(dtype=torch.float32), "dtype float32 not supported (supports float16, bfloat16)"),
        (dict(block_size=8), "block size 8 not supported (supports 16, 32, 64)"),
        (dict(block_size=48), "block size 48 not supported (supports 16, 32, 64)"),
        (dict(head_size=96), "head size 96 not supported (supports 64, 128, 256)"),
        (dict(kv_cache_dtype="fp8"), "kv cache dtype fp8 not supported (supports auto)"),
        (dict(device_type="cpu", device_capability=None), "device type cpu not supported (supports cuda)"),
        (dict(device_capability=DeviceCapability(7, 0), dtype=torch.float16),
         "compute capability 7.0 not supported (supports 7.5..12.1)"),
        (dict(device_capability=DeviceCapability(7, 5)),
         "dtype bfloat16 needs compute capability >= 8.0 (device has 7.5); use float16"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type encoder_only not supported (supports decoder)"),
        (dict(use_mla=True), "MLA not supported"),
    ],
)
def test_validation_reasons(monkeypatch, overrides, reason):
    _install_fake_flashinfer(monkeypatch)  # so the only reason is the one under test
    assert FlashInferBackend.validate_configuration(_config(**overrides)) == [reason]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(dtype=torch.float16, block_size=64, head_size=64),
        dict(head_size=256, block_size=32, device_capability=DeviceCapability(12, 1)),
        dict(dtype=torch.float16, device_capability=DeviceCapability(7, 5)),
        dict(block_size=None),
    ],
)
def test_valid_configurations(monkeypatch, overrides):
    _install_fake_flashinfer(monkeypatch)
    assert FlashInferBackend.validate_configuration(_config(**overrides)) == []


def test_kv_cache_shape_and_split_view():
    shape = FlashInferBackend.get_kv_cache_shape(5, 16, 2, 64)
    assert shape == (5, 2, 16, 2, 64)
    cache = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    k, v = FlashInferBackend.split_kv_cache(cache)
    assert k.shape == v.shape == (5, 16, 2, 64)
    assert torch.equal(k[3, 7], cache[3, 0, 7]) and torch.equal(v[3, 7], cache[3, 1, 7])


# ---------------------------------------------------------------------------- host planning
def test_plan_paged_kv_hand_computed():
    # seq_lens 1, 16, 17, 40 with 16-token pages -> 1, 1, 2, 3 pages.
    qsl = torch.tensor([0, 1, 5, 6, 30], dtype=torch.int32)
    plan = plan_paged_kv(qsl, torch.tensor([1, 16, 17, 40], dtype=torch.int32), 16, 4)
    assert plan.kv_indptr.tolist() == [0, 1, 2, 4, 7]
    assert plan.kv_last_page_len.tolist() == [1, 16, 1, 8]
    assert plan.kv_gather_index.tolist() == [0, 4, 8, 9, 12, 13, 14]
    assert plan.qo_indptr.tolist() == [0, 1, 5, 6, 30]
    assert plan.kv_indptr.dtype == plan.kv_last_page_len.dtype == plan.qo_indptr.dtype == torch.int32
    assert (plan.num_reqs, plan.num_pages, plan.num_query_rows) == (4, 7, 30)

    block_table = torch.tensor(
        [[7, 0, 0, 0], [3, 0, 0, 0], [11, 2, 0, 0], [5, 9, 1, 0]], dtype=torch.int32
    )
    assert gather_kv_indices(block_table, plan).tolist() == [7, 3, 11, 2, 5, 9, 1]
    # A strided view (the first rows of a wider persistent table) gives the same indices.
    wide = torch.full((6, 4), -5, dtype=torch.int32)
    wide[:4] = block_table
    assert gather_kv_indices(wide[:4], plan).tolist() == [7, 3, 11, 2, 5, 9, 1]


def test_plan_paged_kv_page_boundaries_and_empty_sequence():
    plan = plan_paged_kv(torch.tensor([0, 1, 2, 3]), torch.tensor([32, 33, 0]), 32, 3)
    assert plan.kv_indptr.tolist() == [0, 1, 3, 3]
    assert plan.kv_last_page_len.tolist() == [32, 1, 0]
    assert plan.kv_gather_index.tolist() == [0, 3, 4]


def test_plan_paged_kv_rejects_sequences_longer_than_the_block_table():
    with pytest.raises(ValueError, match="needs 3 blocks of 16; the block table has only 2 columns"):
        plan_paged_kv(torch.tensor([0, 1]), torch.tensor([33]), 16, 2)


# ---------------------------------------------------------------------------- KV writes
def test_copy_rows_skipping_invalid():
    dest = torch.zeros(6, 2)
    src = torch.tensor([[1.0, 1], [2, 2], [3, 3], [4, 4]])
    copy_rows_skipping_invalid(dest, torch.tensor([5, -1, 0, -1]), src, torch.tensor([True, False, True, False]))
    assert dest.tolist() == [[3, 3], [0, 0], [0, 0], [0, 0], [0, 0], [1, 1]]

    # The first entry invalid: the anchor is the first *valid* one.
    dest = torch.full((4, 2), 9.0)
    copy_rows_skipping_invalid(dest, torch.tensor([-1, 2]), src[:2], torch.tensor([False, True]))
    assert dest.tolist() == [[9, 9], [9, 9], [2, 2], [9, 9]]

    # Nothing valid: nothing changes.
    dest = torch.arange(8.0).view(4, 2)
    copy_rows_skipping_invalid(dest, torch.tensor([-1, -1]), src[:2], torch.tensor([False, False]))
    assert torch.equal(dest, torch.arange(8.0).view(4, 2))


def test_write_kv_nhd_paired_lands_in_split_view_and_skips_minus_one():
    num_blocks, bs, heads, dim = 4, 16, 2, 8
    cache = torch.zeros(FlashInferBackend.get_kv_cache_shape(num_blocks, bs, heads, dim))
    key = torch.randn(4, heads, dim)
    value = torch.randn(4, heads, dim)
    slots = torch.tensor([3 * bs + 5, -1, 0, bs + 15])
    write_kv_nhd_paired(cache, key, value, slots)
    k_cache, v_cache = FlashInferBackend.split_kv_cache(cache)
    for t, (b, o) in {0: (3, 5), 2: (0, 0), 3: (1, 15)}.items():
        assert torch.equal(k_cache[b, o], key[t]) and torch.equal(v_cache[b, o], value[t])
    assert int((k_cache != 0).any(dim=(-1, -2)).sum()) == 3
    assert int((v_cache != 0).any(dim=(-1, -2)).sum()) == 3


# ---------------------------------------------------------------------------- a stand-in flashinfer
def _find_spec_without(name: str):
    real = importlib.util.find_spec

    def find_spec(module: str, *args, **kwargs):
        return None if module == name else real(module, *args, **kwargs)

    return find_spec


def _standin_paged_attention(q, qo_indptr, kv_cache, kv_indptr, kv_indices, last_page_len, scale, causal,
                             window_left=-1, logits_soft_cap=None):
    """The stand-in's kernel: FlashInfer's paged-attention semantics in float64 (NHD
    single-tensor cache), from the planned CSR arrays alone: the causal mask and the window
    (``window_left`` keys left of the query's own) aligned bottom-right, the soft cap
    ``cap * tanh(s / cap)`` before the mask."""
    page = kv_cache.shape[2]
    heads_q, heads_kv = q.shape[1], kv_cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(len(last_page_len)):
        pages = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])].long()
        kv_len = (len(pages) - 1) * page + int(last_page_len[i]) if len(pages) else 0
        k = kv_cache[pages, 0].reshape(-1, heads_kv, q.shape[2])[:kv_len].double()
        v = kv_cache[pages, 1].reshape(-1, heads_kv, q.shape[2])[:kv_len].double()
        rows = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
        qi = q[rows].double()
        k = k.repeat_interleave(heads_q // heads_kv, dim=1)
        v = v.repeat_interleave(heads_q // heads_kv, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        qpos = torch.arange(qi.shape[0])[:, None] + (kv_len - qi.shape[0])
        kpos = torch.arange(kv_len)[None, :]
        if causal:
            s = s.masked_fill(kpos > qpos, float("-inf"))
        if window_left >= 0:
            s = s.masked_fill(kpos < qpos - window_left, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out


class _FakeWrapper:
    """Shared plan/run bookkeeping of the two stand-in wrappers."""

    causal = False

    def _store(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
               page_size, sm_scale, q_data_type, kv_data_type, window_left, logits_soft_cap):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert len(indptr) == len(last_page_len) + 1 and int(indptr[-1]) == len(indices)
        assert num_qo_heads % num_kv_heads == 0
        if self.use_cuda_graph:
            if len(last_page_len) != self.fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            self.indptr_buf.copy_(indptr)
            self.last_page_len_buf.copy_(last_page_len)
            self.indices_buf[: len(indices)].copy_(indices)
        else:
            self.indptr_buf, self.indices_buf, self.last_page_len_buf = (
                indptr.clone(), indices.clone(), last_page_len.clone()
            )
        self.qo_indptr = qo_indptr.clone()
        self.planned = dict(heads=(num_qo_heads, num_kv_heads), head_dim=head_dim, page_size=page_size,
                            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                            window_left=window_left, logits_soft_cap=logits_soft_cap)
        self.plan_calls += 1

    def run(self, q, paged_kv_cache, *, out=None):
        assert q.dtype == self.planned["q_data_type"] and paged_kv_cache.dtype == self.planned["kv_data_type"]
        assert paged_kv_cache.shape[2] == self.planned["page_size"] and q.shape[-1] == self.planned["head_dim"]
        assert q.shape[0] == int(self.qo_indptr[-1]), "q rows must match the plan"
        batch = len(self.last_page_len_buf)
        result = _standin_paged_attention(
            q, self.qo_indptr, paged_kv_cache, self.indptr_buf[: batch + 1], self.indices_buf,
            self.last_page_len_buf, self.planned["sm_scale"], self.causal, self.planned["window_left"],
            self.planned["logits_soft_cap"],
        )
        if out is None:
            return result.to(q.dtype)
        assert out.shape == q.shape and out.is_contiguous()
        out.copy_(result)
        return out


class _FakePrefillWrapper(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, *, backend="auto"):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.backend, self.use_cuda_graph, self.plan_calls = backend, use_cuda_graph, 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, window_left=-1, logits_soft_cap=None):
        self.causal = causal
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size, sm_scale, q_data_type, kv_data_type, window_left,
                    logits_soft_cap)


class _FakeDecodeWrapper(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph, self.use_tensor_cores, self.plan_calls = use_cuda_graph, use_tensor_cores, 0
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            self.indptr_buf = paged_kv_indptr_buffer
            self.indices_buf = paged_kv_indices_buffer
            self.last_page_len_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type="float16", kv_data_type=None, window_left=-1,
             logits_soft_cap=None):
        assert pos_encoding_mode == "NONE"
        batch = len(last_page_len)
        self._store(torch.arange(batch + 1, dtype=torch.int32), indptr, indices, last_page_len, num_qo_heads,
                    num_kv_heads, head_dim, page_size, sm_scale, q_data_type, kv_data_type, window_left,
                    logits_soft_cap)


def _install_fake_flashinfer(monkeypatch) -> types.ModuleType:
    fake = types.ModuleType("flashinfer")
    fake.__spec__ = importlib.machinery.ModuleSpec("flashinfer", loader=None)
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefillWrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    # The builder module binds the library at import: import it afresh against the stand-in.
    monkeypatch.delitem(sys.modules, "kvloom_backend_flashinfer.builder", raising=False)
    return fake


# ---------------------------------------------------------------------------- steps
HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16
SCALE = 1 / math.sqrt(DIM)
MAX_NUM_SEQS, MAX_MODEL_LEN = 8, 256


def _spec(dtype=torch.float32, **features) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=dtype,
                              kv_cache_dtype=dtype, block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS,
                              max_model_len=MAX_MODEL_LEN, scale=SCALE, **features)


def _case(requests, *, seed: int, pad_reqs: int = 0, fill: str = "nan", **features) -> PagedCase:
    """One step of ``(context_len, query_len)`` requests on shuffled blocks of a fresh
    cache (float32, which the stand-in computes in float64), with ``pad_reqs`` CUDA-graph
    filler requests; slots no request owns (and, with a window, the blocks wholly before
    it) hold ``fill``. ``features``: ``sliding_window`` / ``logits_soft_cap``."""
    return make_paged_case(
        FlashInferBackend, [q for _, q in requests], [c + q for c, q in requests], num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_size=DIM, block_size=BLOCK, dtype=torch.float32, seed=seed,
        pad_reqs=pad_reqs, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, fill=fill, **features,
    )


@pytest.fixture
def backend_parts(monkeypatch):
    """The stand-in flashinfer, and one builder and impl for all steps of a test."""
    fake = _install_fake_flashinfer(monkeypatch)
    builder = FlashInferBackend.get_builder_cls()(_spec(), torch.device("cpu"), max_num_blocks=64)
    impl = FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS)
    return fake, builder, impl


def _check(case: PagedCase, run: PagedRun) -> None:
    """The cache exactly as a correct step leaves it, and each real request's output
    within 1e-5 of the float64 reference (relative, worst request)."""
    check = check_paged_case(case, run)
    assert not check.problems, check.problems
    assert check.rel_error < 1e-5, check


@pytest.mark.parametrize(
    "requests",
    [
        [(0, 37)],  # one prefill
        [(0, 5), (0, 16), (0, 33)],  # several prefills
        [(20, 7), (48, 16), (3, 1)],  # chunked prefill with context (+ a decode)
        [(40, 1), (0, 9), (17, 1), (31, 20), (64, 1)],  # decodes and prefills interleaved
    ],
)
def test_prefill_and_mixed_steps_match_reference(backend_parts, requests):
    fake, builder, impl = backend_parts
    case = _case(requests, seed=len(requests))
    run = run_paged_case(case, builder=builder, impl=impl)
    meta = run.metadata
    assert not meta.is_decode and isinstance(meta.wrapper, _FakePrefillWrapper)
    assert meta.wrapper.backend == "fa2" and meta.wrapper.causal
    assert meta.wrapper.planned["sm_scale"] == SCALE
    _check(case, run)


def test_decode_step_uses_decode_wrapper(backend_parts):
    fake, builder, impl = backend_parts
    case = _case([(40, 1), (0, 1), (100, 1)], seed=7)
    run = run_paged_case(case, builder=builder, impl=impl)
    assert run.metadata.is_decode and isinstance(run.metadata.wrapper, _FakeDecodeWrapper)
    assert run.metadata.wrapper.use_tensor_cores and not run.metadata.wrapper.use_cuda_graph
    _check(case, run)


def test_slot_minus_one_is_not_written(backend_parts):
    fake, builder, impl = backend_parts
    case = _case([(0, 5), (16, 3)], seed=3, fill="zeros")
    case.common.slot_mapping[2] = -1
    before = case.kv_cache.clone()
    run_paged_case(case, builder=builder, impl=impl)
    changed = (case.kv_cache != before).any(dim=(-1, -2))  # [blocks, 2, block_size]
    # 7 of the 8 new tokens were written (K and V each); token 2 was skipped.
    assert int(changed[:, 0].sum()) == 7 and int(changed[:, 1].sum()) == 7


def test_cudagraph_decode_wrappers_per_batch_size(backend_parts):
    fake, builder, impl = backend_parts
    # Capture sizes 4 and 2 (dummy batches of fillers alone), as a model runner would before serving.
    capture4, capture2 = _case([], pad_reqs=4, seed=11), _case([], pad_reqs=2, seed=12)
    run4 = run_paged_case(capture4, builder=builder, impl=impl, for_cudagraph=True)
    run2 = run_paged_case(capture2, builder=builder, impl=impl, for_cudagraph=True)
    assert not check_paged_case(capture4, run4).problems and not check_paged_case(capture2, run2).problems
    w4, w2 = run4.metadata.wrapper, run2.metadata.wrapper
    assert w4 is not w2 and w4.use_cuda_graph and w2.use_cuda_graph and w4.use_tensor_cores
    assert (w4.fixed_batch_size, w2.fixed_batch_size) == (4, 2)
    assert w4.indices_buf.data_ptr() == w2.indices_buf.data_ptr()  # shared persistent buffers
    assert w4.indptr_buf.data_ptr() == w2.indptr_buf.data_ptr()

    # A later decode step of 3 requests padded to 4 is planned into the size-4 wrapper's buffers.
    case = _case([(30, 1), (64, 1), (5, 1)], pad_reqs=1, seed=13)
    run = run_paged_case(case, builder=builder, impl=impl)
    assert run.metadata.wrapper is w4 and w4.plan_calls == 2 and run.metadata.num_query_rows == 4
    _check(case, run)
    # The persistent buffers hold this step's CSR arrays.
    assert w4.indptr_buf.tolist() == [0, 2, 7, 8, 9]
    assert w4.last_page_len_buf.tolist() == [15, 1, 6, 1]

    # A decode step of a size without a graph uses the eager decode wrapper.
    case5 = _case([(3, 1)] * 5, seed=14)
    run5 = run_paged_case(case5, builder=builder, impl=impl)
    assert not run5.metadata.wrapper.use_cuda_graph
    _check(case5, run5)


def test_cudagraph_capture_refuses_non_decode_batches(backend_parts):
    fake, builder, impl = backend_parts
    with pytest.raises(ValueError, match="uniform single-token decode"):
        builder.build_for_cudagraph_capture(_case([(0, 4), (8, 1)], seed=1).common)
    with pytest.raises(ValueError, match="CUDA-graph batch size 9 out of range 1..8"):
        builder.build_for_cudagraph_capture(_case([], pad_reqs=9, seed=1).common)


@pytest.mark.parametrize(
    ("requests", "window"),
    [
        ([(0, 37)], 8),  # a prefill longer than the window
        ([(70, 1), (0, 9), (33, 1), (45, 20)], 20),  # decodes with pages wholly before their window
        ([(100, 1), (64, 1), (17, 1)], 16),  # a decode step: the decode wrapper
        ([(20, 7), (48, 16)], 200),  # a window longer than every sequence
    ],
)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_sliding_window_and_soft_cap_match_reference(monkeypatch, requests, window, cap):
    """The blocks wholly before a window hold NaN: a plan that still listed them would
    spread NaN into the output, so matching the reference also shows they are not read."""
    _install_fake_flashinfer(monkeypatch)
    features = dict(sliding_window=window, logits_soft_cap=cap)
    builder = FlashInferBackend.get_builder_cls()(_spec(**features), torch.device("cpu"), max_num_blocks=64)
    impl = FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS,
                                            **features)
    case = _case(requests, seed=window, **features)
    run = run_paged_case(case, builder=builder, impl=impl)
    planned = run.metadata.wrapper.planned
    assert (planned["window_left"], planned["logits_soft_cap"]) == (window - 1, cap)
    _check(case, run)


def test_plan_paged_kv_leaves_out_the_pages_before_each_window():
    # seq_len 70 (query 1: position 69) with window 20 sees positions 50..69: pages 3, 4 of 16.
    # seq_len 45 with query 20 (positions 25..44) sees from 6 on: pages 0..2. seq_len 9: page 0.
    qsl = torch.tensor([0, 1, 21, 30], dtype=torch.int32)
    plan = plan_paged_kv(qsl, torch.tensor([70, 45, 9], dtype=torch.int32), 16, 5, sliding_window=20)
    assert plan.kv_indptr.tolist() == [0, 2, 5, 6]
    assert plan.kv_gather_index.tolist() == [3, 4, 5, 6, 7, 10]
    assert plan.kv_last_page_len.tolist() == [6, 13, 9]


def test_forward_refuses_a_layer_unlike_the_plan(backend_parts):
    fake, builder, impl = backend_parts
    impl_cls = FlashInferBackend.get_impl_cls()
    case = _case([(0, 3)], seed=2)
    meta = builder.build(case.common)
    for other in (impl_cls(num_heads=HEADS, head_size=DIM, scale=0.5, num_kv_heads=KV_HEADS),
                  impl_cls(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS, sliding_window=4),
                  impl_cls(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS, logits_soft_cap=3.0)):
        with pytest.raises(ValueError, match=r"\(scale, sliding_window, logits_soft_cap\) .* differs from the step's plan"):
            other.forward(case.query, case.key, case.value, case.kv_cache, meta, torch.empty_like(case.query))


def test_impl_rejects_unsupported_features():
    impl_cls = FlashInferBackend.get_impl_cls()
    with pytest.raises(NotImplementedError, match="attention sinks not supported"):
        impl_cls(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2, sinks=torch.zeros(8))
    with pytest.raises(NotImplementedError, match=r"attn_type encoder_only not supported \(supports decoder\)"):
        impl_cls(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2, attn_type=AttentionType.ENCODER_ONLY)
