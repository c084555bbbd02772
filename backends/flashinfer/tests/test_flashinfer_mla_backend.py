"""CPU tests of FLASHINFER_MLA (flashinfer is not installed here): declarations, validation
reasons, the phase it implements, that the declarations import no flashinfer, and the
builder/impl plumbing through the MLA conformance kit's decode cases against a stand-in
``flashinfer.mla`` (FlashInfer 0.7's plan/run signatures and metadata checks, attention
computed from the planned CSR arrays). Its kernels run in the GPU tests
(test_flashinfer_mla_gpu.py, tests/gpu/test_mla_gpu.py, tests/gpu/test_conformance_gpu.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import kvloom_backend_flashinfer  # noqa: F401
except ImportError:  # the venv script skips installing this package: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom_backend_flashinfer import FlashInferMLABackend

from kvloom.interfaces import AttentionCGSupport, AttentionSelectorConfig, DeviceCapability

H100 = DeviceCapability(9, 0)


def _config(**overrides: object) -> AttentionSelectorConfig:
    base = dict(head_size=576, dtype=torch.bfloat16, block_size=64, device_type="cuda", device_capability=H100,
                num_heads=16, num_kv_heads=1, use_mla=True, mla_phase="decode")
    base.update(overrides)
    return AttentionSelectorConfig(**base)  # type: ignore[arg-type]


def _flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def test_declarations() -> None:
    assert FlashInferMLABackend.NAME == "FLASHINFER_MLA"
    assert FlashInferMLABackend.is_mla and FlashInferMLABackend.mla_phases == ("decode",)
    assert FlashInferMLABackend.cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert FlashInferMLABackend.get_kv_cache_shape(7, 64, 1, 576) == (7, 64, 576)
    assert FlashInferMLABackend.required_modules == {"flashinfer": "flashinfer-python"}


def test_valid_decode_on_hopper_when_flashinfer_is_there() -> None:
    reasons = FlashInferMLABackend.validate_configuration(_config())
    expected = [] if _flashinfer_importable() else ["flashinfer is not installed (pip install flashinfer-python)"]
    assert reasons == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"mla_phase": "prefill", "head_size": 192}, "MLA prefill not supported (implements decode)"),
        ({"head_size": 48}, "head size 48 not supported (supports 576)"),
        ({"dtype": torch.float32}, "dtype float32 not supported"),
        ({"block_size": 1}, "block size 1 not supported (supports 16, 32, 64)"),
        ({"use_mla": False, "mla_phase": None, "head_size": 128}, "only MLA models"),
        ({"device_capability": DeviceCapability(7, 5)}, "compute capability"),
    ],
)
def test_invalid_configurations_name_the_reason(overrides: dict, expected: str) -> None:
    reasons = FlashInferMLABackend.validate_configuration(_config(**overrides))
    assert any(expected in r for r in reasons), reasons


def test_importing_the_backend_does_not_import_flashinfer() -> None:
    code = (
        "import sys; sys.path.insert(0, %r); import kvloom_backend_flashinfer as m; "
        "m.FlashInferMLABackend.validate_configuration; print('flashinfer' in sys.modules)"
    ) % str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------------------- stand-in library
class _FakeMLAPlanMetadata:
    """``flashinfer.mla.MLAPlanMetadata`` (0.7): only the CSR form is used."""

    def __init__(self, **fields: torch.Tensor) -> None:
        self.__dict__.update(fields)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):  # type: ignore[no-untyped-def]
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


class _FakeMLAWrapper:
    """``BatchMLAPagedAttentionWrapper`` of FlashInfer 0.7 as the backend calls it, with the
    library's metadata checks (int32, contiguous, CPU or wrapper device, page counts equal
    to ceil(kv_len / page_size), CUDA-graph buffers of exactly the planned batch size) and
    ``run`` computing attention from the CSR arrays in float64. A CUDA-graph wrapper's run
    reads the arrays back from its reserved buffers, as the captured kernel would."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,  # type: ignore[no-untyped-def]
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in ("auto", "fa2", "fa3")
        self.use_cuda_graph = use_cuda_graph
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.planned = None

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,  # type: ignore[no-untyped-def]
             q_data_type, kv_data_type):
        arrays = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr)
        for t in arrays:
            assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous()
        qo, kv_indptr, kv_indices, kv_len = (t.cpu().long() for t in arrays)
        assert len(kv_indptr) == len(kv_len) + 1 == len(qo) and int(kv_indptr[-1]) <= len(kv_indices)
        assert torch.equal(kv_indptr[1:] - kv_indptr[:-1], (kv_len + page_size - 1) // page_size)
        assert not causal and q_data_type == kv_data_type
        if self.use_cuda_graph:
            for reserved, source, larger_ok in zip(self.bufs, arrays, (False, False, True, False)):
                assert reserved.shape[0] >= source.shape[0] if larger_ok else reserved.shape == source.shape
                reserved[: source.shape[0]].copy_(source)
            arrays = self.bufs
        self.planned = (arrays, num_heads, head_dim_ckv, head_dim_kpe, page_size, sm_scale)

    def run(self, *, query, kv_cache, out):  # type: ignore[no-untyped-def]
        (qo, kv_indptr, kv_indices, kv_len), num_heads, ckv, kpe, page_size, scale = self.planned
        assert query.shape[1:] == (num_heads, ckv + kpe) and kv_cache.shape[1:] == (page_size, ckv + kpe)
        assert out.shape == (query.shape[0], num_heads, ckv)
        for b in range(len(kv_len)):
            pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            rows = kv_cache[pages].reshape(-1, ckv + kpe)[: int(kv_len[b])].double()
            s = query[b].double() @ rows.T * scale
            out[b] = (torch.softmax(s, -1) @ rows[:, :ckv]).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):  # type: ignore[no-untyped-def]
    import types

    fake = types.ModuleType("flashinfer")
    fake.__spec__ = importlib.machinery.ModuleSpec("flashinfer", loader=None)
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeMLAWrapper
    mla.MLAPlanMetadata = _FakeMLAPlanMetadata
    fake.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    # mla.py binds the library at import: import it afresh against the stand-in.
    monkeypatch.delitem(sys.modules, "kvloom_backend_flashinfer.mla", raising=False)
    return fake


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_conformance_decode_through_the_stand_in(fake_flashinfer, block_size: int) -> None:  # type: ignore[no-untyped-def]
    """The MLA conformance kit's decode cases (latent write with padding, decode over
    shuffled paged latent rows, long contexts) through FLASHINFER_MLA's builder and impl:
    checks the CSR plan, the page-size/length bookkeeping and the packed-input wiring."""
    from kvloom.testing.conformance import MLAConformanceCase
    from kvloom.testing.conformance.mla import run_mla_case

    for scenario in ("mla_decode", "mla_long_decode"):
        case = MLAConformanceCase(scenario, torch.float32, block_size)
        outcome = run_mla_case(FlashInferMLABackend, case, torch.device("cpu"), seed=block_size)
        assert not outcome.problems, outcome.problems
        assert outcome.worst < 1e-5, (scenario, outcome.worst, outcome.worst_where)


def test_graph_plan_rewrites_the_reserved_buffers(fake_flashinfer) -> None:  # type: ignore[no-untyped-def]
    """Planning a captured batch size again (before a replay) must land in the same
    reserved buffers the wrapper was created with, with the new lengths and pages."""
    from kvloom.interfaces import AttentionLayerSpec, CommonAttentionMetadata, MLADims

    from kvloom.testing.mla_decode import make_decode_case

    dims = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16)
    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=1, head_size=576, dtype=torch.float32,
                              kv_cache_dtype=torch.float32, block_size=16, max_num_seqs=4, max_model_len=256,
                              scale=0.05, extra={**dims.to_extra(), "mla_phase": "decode"})
    builder = FlashInferMLABackend.get_builder_cls()(spec, torch.device("cpu"), 16)
    impl = FlashInferMLABackend.get_impl_cls()(dims, 0.05)
    wrappers = set()
    for seed, lens in enumerate(([3, 200], [150, 17])):
        case = make_decode_case(lens, num_heads=4, kv_lora_rank=512, rope_dim=64, block_size=16,
                                dtype=torch.float32, seed=seed)
        case.scale = 0.05
        b = len(lens)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, seq_lens=case.seq_lens, block_table=case.block_table,
            slot_mapping=torch.zeros(b, dtype=torch.int64), num_reqs=b, num_actual_tokens=b, max_query_len=1,
            max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=case.seq_lens.clone(),
        )
        md = builder.build_for_cudagraph_capture(common)
        wrappers.add(id(md.decoder._planned))
        out = torch.full((b, 4, 512), float("nan"))
        impl.forward_decode(case.q, case.kv_cache, md, out)
        assert torch.allclose(out.double(), case.reference(), atol=1e-5, rtol=1e-5)
    assert len(wrappers) == 1  # one graph wrapper for batch size 2, planned twice
