"""CPU_MLA: the MLA conformance cases, and the kit's power to catch broken MLA backends."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from kvloom.interfaces import MLAAttentionBackend
from kvloom.testing import check_case, conformance_cases, run_case
from kvloom.testing.conformance import MLAConformanceCase, run_conformance
from kvloom_backend_cpu.mla import CPUMLABackend, CPUMLAImpl


@pytest.mark.parametrize("case", conformance_cases(CPUMLABackend, quick=True), ids=str)
def test_conformance(case: MLAConformanceCase) -> None:
    check_case(CPUMLABackend, case)


def test_cases_cover_both_phases_and_every_declared_block_size() -> None:
    cases = conformance_cases(CPUMLABackend)
    assert {c.scenario for c in cases} == {"mla_decode", "mla_long_decode", "mla_prefill", "mla_chunked_prefill"}
    assert {c.dtype for c in cases} == set(CPUMLABackend.supported_dtypes)
    assert {c.block_size for c in cases if c.scenario == "mla_decode"} == {1, 2, 16, 256, 512}


def test_registered_through_its_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="kvloom.attention_backends")
    (ep,) = [e for e in eps if e.name == "CPU_MLA"]
    assert ep.load() is CPUMLABackend
    assert ep.dist is not None and ep.dist.name == "kvloom-backend-cpu"
    assert CPUMLABackend.is_mla and CPUMLABackend.mla_phases == ("decode", "prefill")
    assert CPUMLABackend.get_kv_cache_shape(7, 16, 1, 576) == (7, 16, 576)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        CPUMLABackend.get_kv_cache_shape(7, 16, 2, 576)


class _ReadsPastSequence(CPUMLAImpl):
    """Broken: the decode mask is dropped, so padding rows past seq_len are attended."""

    def forward_decode(self, q, kv_cache, attn_metadata, out):
        attn_metadata.decode.key_mask = torch.ones_like(attn_metadata.decode.key_mask)
        return super().forward_decode(q, kv_cache, attn_metadata, out)


class _WritesPadding(CPUMLAImpl):
    """Broken: the -1 padding rows are written to the last slot."""

    def write_latent(self, kv_c_normed, k_pe, kv_cache, slot_mapping):
        fixed = torch.where(slot_mapping < 0, kv_cache.shape[0] * kv_cache.shape[1] - 1, slot_mapping)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        n = slot_mapping.shape[0]
        flat[fixed] = torch.cat([kv_c_normed[:n], k_pe[:n]], dim=-1)


class _NotCausal(CPUMLAImpl):
    """Broken: chunked prefill ignores the causal mask over the cached prefix."""

    def forward_prefill(self, q, k, v, attn_metadata, out):
        for r in attn_metadata.prefills:
            r.mask = None if r.mask is None else torch.ones_like(r.mask)
        return super().forward_prefill(q, k, v, attn_metadata, out)


def _broken(impl: type[CPUMLAImpl]) -> type[MLAAttentionBackend]:
    return type("BROKEN_MLA", (CPUMLABackend,), {"NAME": "BROKEN_MLA", "get_impl_cls": staticmethod(lambda: impl)})


@pytest.mark.parametrize(
    ("impl", "scenario", "message"),
    [
        (_ReadsPastSequence, "mla_decode", "relative error"),
        (_WritesPadding, "mla_decode", "latent cache differs"),
        (_NotCausal, "mla_chunked_prefill", "relative error"),
    ],
)
def test_the_kit_catches_broken_mla_backends(impl, scenario, message) -> None:
    case = MLAConformanceCase(scenario, torch.float32, 16)
    result = run_case(_broken(impl), case, seed=3)
    assert not result.passed and message in result.message


def test_a_decode_only_backend_runs_only_decode_cases() -> None:
    decode_only = type("DECODE_ONLY", (CPUMLABackend,), {"NAME": "DECODE_ONLY", "mla_phases": ("decode",)})
    scenarios = {c.scenario for c in conformance_cases(decode_only)}
    assert scenarios == {"mla_decode", "mla_long_decode"}
    report = run_conformance(decode_only, quick=True, seed=1)
    assert report.passed, report.format()
