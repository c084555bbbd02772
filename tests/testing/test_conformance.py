"""The conformance suite itself: it passes an independent correct backend and catches
each kind of bug a backend can have (so a green suite means something)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from kvloom.testing import ConformanceReport, conformance_cases, run_case, run_conformance
from kvloom.testing.conformance import ConformanceCase


@dataclass
class NaiveMetadata:
    common: CommonAttentionMetadata
    block_size: int


class NaiveBuilder(AttentionMetadataBuilder[NaiveMetadata]):
    def build(self, common: CommonAttentionMetadata) -> NaiveMetadata:
        return NaiveMetadata(common, self.spec.block_size)


class NaiveImpl(AttentionImpl[NaiveMetadata]):
    """A slow, obviously-correct paged attention: a loop over requests in float32.

    ``bug`` switches on one deliberate mistake."""

    bug: str | None = None

    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        md = attn_metadata.common
        bs = attn_metadata.block_size
        bug = self.bug
        n = md.num_actual_tokens
        k_flat = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        v_flat = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        rows = len(md.slot_mapping) if bug == "writes_padding" else n
        for t in range(rows):
            slot = int(md.slot_mapping[t])
            if slot >= 0 or bug == "writes_padding":  # -1 indexes the last slot
                k_flat[slot] = key[t]
                v_flat[slot] = value[t]
        starts = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens_cpu.tolist()
        num_reqs = md.num_reqs - (1 if bug == "skips_last_request" else 0)
        group = self.num_heads // self.num_kv_heads
        scale = self.head_size**-0.5 if bug == "ignores_scale" else self.scale
        for i in range(num_reqs):
            start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            if end > n or end == start:
                continue
            q_len = end - start
            context = seq_len - q_len
            shift = 1 if bug == "off_by_one_causal" else 0
            # The off-by-one variant also reads the slot after the sequence, as a paged
            # kernel with that bug would.
            positions = torch.arange(seq_len + shift)
            if bug == "contiguous_blocks":  # assumes a request's blocks are consecutive
                blocks = md.block_table[i, 0] + positions // bs
            else:
                blocks = md.block_table[i, (positions // bs).tolist()]
            slots = blocks.long() * bs + positions % bs
            keys, values = k_flat[slots].float(), v_flat[slots].float()
            if bug == "drops_context":
                keys, values, context = keys[context:], values[context:], 0
            heads = torch.arange(self.num_heads)
            kv_head = heads % self.num_kv_heads if bug == "gqa_modulo" else heads // group
            k = keys[:, kv_head]  # [seq, H, D]
            v = values[:, kv_head]
            q = query[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            visible = torch.arange(k.shape[0])[None, :] <= torch.arange(context, context + q_len)[:, None] + shift
            scores = scores.masked_fill(~visible, float("-inf"))
            output[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(output.dtype)
        return output


def make_backend(bug: str | None = None) -> type[AttentionBackend]:
    impl = type(f"NaiveImpl_{bug}", (NaiveImpl,), {"bug": bug})

    class NaiveBackend(AttentionBackend):
        NAME = f"NAIVE_{bug or 'OK'}".upper()
        supported_dtypes = (torch.float32, torch.bfloat16)
        supported_block_sizes = (MultipleOf(8),)
        supported_head_sizes = (64, 96)
        supported_device_types = ("cpu",)

        @staticmethod
        def get_impl_cls():
            return impl

        @staticmethod
        def get_builder_cls():
            return NaiveBuilder

        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

    return NaiveBackend


def test_an_independent_correct_backend_passes_the_quick_suite() -> None:
    report = run_conformance(make_backend(), quick=True, seed=7)
    assert report.passed, report.format()
    scenarios = {c.params["scenario"] for c in report.cases}
    assert scenarios == {
        "kv_write", "prefill", "chunked_prefill", "decode", "long_decode", "mixed", "padded_tokens", "cudagraph_padding"
    }


@pytest.mark.parametrize(
    ("bug", "failing_scenario", "symptom"),
    [
        ("off_by_one_causal", "prefill", "relative error"),
        ("writes_padding", "padded_tokens", "cache:"),
        ("skips_last_request", "decode", "not fully written"),
        ("ignores_scale", "chunked_prefill", "relative error"),
        ("drops_context", "chunked_prefill", "relative error"),
        ("gqa_modulo", "mixed", "relative error"),
        ("contiguous_blocks", "decode", ""),
    ],
)
def test_the_suite_catches_a_buggy_backend(bug: str, failing_scenario: str, symptom: str) -> None:
    backend = make_backend(bug)
    cases = [c for c in conformance_cases(backend, quick=True) if c.scenario == failing_scenario]
    report = run_conformance(backend, quick=True, seed=11, cases=cases)
    assert not report.passed
    failed = [c for c in report.failed if c.params["scenario"] == failing_scenario]
    assert failed, report.format()
    assert symptom in failed[0].message
    assert "reproduce" in report.format() and "seed=11" in report.format()


def test_off_by_one_in_decode_is_caught_in_fp32() -> None:
    # One extra (garbage) key among ~100 is a small change: fp32's tolerance must see it.
    case = ConformanceCase("decode", torch.float32, 8, 2, 64, 8)
    assert not run_case(make_backend("off_by_one_causal"), case, seed=3).passed
    assert run_case(make_backend(), case, seed=3).passed


def test_declared_support_drives_the_cases() -> None:
    cases = conformance_cases(make_backend())
    assert {c.dtype for c in cases} == {torch.float32, torch.bfloat16}
    assert {c.head_size for c in cases} == {64, 96}
    # MultipleOf(8): 8, 16 (2n), the preferred 16, and 256/512 which it accepts.
    assert {c.block_size for c in cases} == {8, 16, 256, 512}
    assert {(c.num_heads, c.num_kv_heads) for c in cases} == {(4, 4), (8, 2), (16, 2), (8, 1)}
    quick = conformance_cases(make_backend(), quick=True)
    assert len(quick) < len(cases)


def test_cases_the_backend_rejects_are_skipped_not_failed() -> None:
    backend = make_backend()
    case = ConformanceCase("mixed", torch.float32, 8, 2, 80, 16)  # head size 80 not declared
    result = run_case(backend, case, seed=1)
    assert result.skipped and "head size 80 not supported" in result.message


def test_report_fails_on_an_unsupported_device_type() -> None:
    report = run_conformance(make_backend(), device="meta", quick=True, seed=1)
    assert not report.passed
    assert "does not support device type meta" in report.format()


def test_a_crashing_backend_fails_with_its_traceback() -> None:
    class Boom(NaiveImpl):
        def forward(self, *args, **kwargs):
            raise RuntimeError("kernel exploded")

    backend = make_backend()
    backend.get_impl_cls = staticmethod(lambda: Boom)
    result = run_case(backend, ConformanceCase("decode", torch.float32, 8, 2, 64, 8), seed=1)
    assert not result.passed and "RuntimeError: kernel exploded" in result.message


def test_same_seed_same_data_and_report_fields() -> None:
    case = ConformanceCase("mixed", torch.bfloat16, 8, 1, 64, 16)
    a = run_case(make_backend(), case, seed=5)
    b = run_case(make_backend(), case, seed=5)
    assert a.rel_error == b.rel_error and a.passed
    assert a.params["seed"] == 5 and a.tolerance == 1e-2
    strict = run_case(make_backend(), case, seed=5, tolerances={torch.bfloat16: 1e-9})
    assert not strict.passed and "tolerance" in strict.message
    report = ConformanceReport("X", "cpu", 5, True, [a])
    assert report.passed and "PASSED" in report.format()


def test_backend_names_resolve_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloom.attention import selector

    backend = make_backend()
    monkeypatch.setattr(selector, "get_attention_backend", lambda name: {"NAIVE_OK": backend}[name])
    cases = conformance_cases("NAIVE_OK", quick=True)[:2]
    report = run_conformance("NAIVE_OK", quick=True, seed=2, cases=cases)
    assert report.passed and report.backend == "NAIVE_OK"
    missing = run_conformance("NOPE", quick=True, seed=2)
    assert not missing.passed and "cannot load backend 'NOPE'" in missing.format()
