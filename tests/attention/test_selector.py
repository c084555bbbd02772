"""Backend selection with simulated GPUs (SM75, SM80, SM90, SM100) and fake backends.

The CUDA platform's priority lists must reproduce vLLM's tables ("Attention Backend
Feature Support", Backend Priority (CUDA)); the fake backends declare the support the
same document's feature tables give the real ones, so the outcome of "first valid in
priority order" and the error messages can be checked without any GPU.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    AttentionType,
    MultipleOf,
)
from kvloom.platforms.interface import DeviceCapability
from kvloom.plugins import ATTENTION_BACKENDS
from kvloom.attention.selector import (
    BackendSelectionError,
    report_attention_backends,
    select_attention_backend,
)
from kvloom_registry import PluginEntry, PluginLoadError
from kvloom.attention.selector import select_backend

kvloom_platform_cuda = pytest.importorskip("kvloom_platform_cuda.platform")
kvloom_platform_cpu = pytest.importorskip("kvloom_platform_cpu.platform")
CudaPlatform = kvloom_platform_cuda.CudaPlatform
CpuPlatform = kvloom_platform_cpu.CpuPlatform

SM75, SM80, SM90, SM100 = (DeviceCapability(7, 5), DeviceCapability(8, 0), DeviceCapability(9, 0), DeviceCapability(10, 0))


class FakeBackend(AttentionBackend):
    """Declarations only: selection never instantiates or runs a backend."""

    NAME: ClassVar[str] = "FAKE"
    provider: ClassVar[str] = "fake"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError("fake backend for selection tests")

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        raise NotImplementedError("fake backend for selection tests")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class FakeSparse(FakeBackend):
    @classmethod
    def extra_validation(cls, config: AttentionSelectorConfig) -> list[str]:
        return ["sparse attention only (the model is not sparse)"]


def fake(name: str, provider: str, base: type[FakeBackend] = FakeBackend, **support: Any) -> type[AttentionBackend]:
    return type(name, (base,), {"NAME": name, "provider": provider, "supported_device_types": ("cuda",), **support})


HALF = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_BLOCK = (MultipleOf(1),)
ALL_TYPES = tuple(AttentionType)
MLA = "kvloom-backend-mla"

# Declared support as in the seed's feature tables.
STANDARD_FAKES = [
    fake("FLASH_ATTN", "kvloom-backend-flash-attn", supported_dtypes=HALF,
         supported_kv_cache_dtypes=("auto", "bfloat16"), supported_block_sizes=(MultipleOf(16),),
         min_compute_capability=SM80, supported_attn_types=ALL_TYPES),
    fake("FLASHINFER", "kvloom-backend-flashinfer", supported_dtypes=HALF,
         supported_kv_cache_dtypes=("auto", "bfloat16", "fp8"), supported_block_sizes=(16, 32, 64),
         supported_head_sizes=(64, 128, 256), min_compute_capability=SM75,
         max_compute_capability=DeviceCapability(12, 1)),
    fake("TRITON_ATTN", "kvloom-backend-triton", supported_dtypes=ALL_DTYPES,
         supported_kv_cache_dtypes=("auto", "bfloat16", "fp8"), supported_block_sizes=(MultipleOf(16),),
         supported_attn_types=ALL_TYPES),
    fake("FLEX_ATTENTION", "kvloom-backend-flex-attention", supported_dtypes=ALL_DTYPES,
         supported_kv_cache_dtypes=("auto", "bfloat16"), supported_block_sizes=ANY_BLOCK,
         supported_attn_types=(AttentionType.DECODER, AttentionType.ENCODER_ONLY)),
]
MLA_ANY_HEAD = dict(is_mla=True, max_head_size=1024)  # "Any" head size in the tables
SM10X = dict(min_compute_capability=DeviceCapability(10, 0), max_compute_capability=DeviceCapability(10, 9))
SM9X_10X = dict(min_compute_capability=SM90, max_compute_capability=DeviceCapability(10, 9))
MLA_FAKES = [
    fake("FLASHINFER_MLA", MLA, **MLA_ANY_HEAD, supported_dtypes=HALF, supported_block_sizes=(32, 64), **SM10X),
    fake("CUTLASS_MLA", MLA, **MLA_ANY_HEAD, supported_dtypes=HALF, supported_block_sizes=(128,), **SM10X),
    fake("FLASH_ATTN_MLA", MLA, **MLA_ANY_HEAD, supported_dtypes=HALF, supported_block_sizes=(MultipleOf(16),),
         min_compute_capability=SM90, max_compute_capability=DeviceCapability(9, 9)),
    fake("FLASHMLA", MLA, **MLA_ANY_HEAD, supported_dtypes=HALF, supported_block_sizes=(64,), **SM9X_10X),
    fake("TRITON_MLA", MLA, **MLA_ANY_HEAD, supported_dtypes=HALF, supported_block_sizes=ANY_BLOCK),
    fake("FLASHMLA_SPARSE", MLA, FakeSparse, **MLA_ANY_HEAD, supported_dtypes=(torch.bfloat16,),
         supported_block_sizes=(64,), supported_head_sizes=(576,), **SM9X_10X),
    fake("FLASHINFER_MLA_SPARSE", MLA, FakeSparse, **MLA_ANY_HEAD, supported_dtypes=HALF,
         supported_block_sizes=(32, 64), supported_head_sizes=(576,), **SM10X),
]


def entries(*backends: type[AttentionBackend]) -> dict[str, PluginEntry]:
    return {
        b.NAME: PluginEntry(b.NAME, ATTENTION_BACKENDS, b.provider, "0.0.test", f"fakes:{b.NAME}", b)  # type: ignore[attr-defined]
        for b in backends
    }


ALL_FAKES = entries(*STANDARD_FAKES, *MLA_FAKES)


def cuda_config(capability: DeviceCapability | None, **overrides: Any) -> AttentionSelectorConfig:
    values: dict[str, Any] = dict(head_size=128, dtype=torch.bfloat16, device_type="cuda", device_capability=capability)
    values.update(overrides)
    return AttentionSelectorConfig(**values)


# ---------------------------------------------------------------------- the seed's tables

# kvloom's measured order below SM 10 (docs/benchmarks/gpu_h100.md; vLLM's: FLASH_ATTN, FLASHINFER, TRITON_ATTN).
STANDARD_AMPERE_HOPPER = ["TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]
STANDARD_BLACKWELL = ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
MLA_AMPERE_HOPPER = ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE"]
MLA_BLACKWELL = ["FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA",
                 "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]


@pytest.mark.parametrize(
    ("capability", "use_mla", "expected"),
    [
        (SM80, False, STANDARD_AMPERE_HOPPER),
        (SM90, False, STANDARD_AMPERE_HOPPER),
        (SM100, False, STANDARD_BLACKWELL),
        (DeviceCapability(10, 3), False, STANDARD_BLACKWELL),
        (None, False, STANDARD_AMPERE_HOPPER),
        (SM80, True, MLA_AMPERE_HOPPER),
        (SM90, True, MLA_AMPERE_HOPPER),
        (SM100, True, MLA_BLACKWELL),
    ],
)
def test_cuda_priority_tables(capability: DeviceCapability | None, use_mla: bool, expected: list[str]) -> None:
    assert [c.name for c in CudaPlatform.get_attn_backend_priority(use_mla, capability)] == expected
    # The same order, 1-based, in the selection report (backends not installed here).
    config = cuda_config(capability, use_mla=use_mla)
    report = report_attention_backends(CudaPlatform, config, backends={})
    assert [(c.priority, c.name) for c in report.candidates] == list(enumerate(expected, start=1))


def test_missing_backends_name_their_pip_package() -> None:
    report = report_attention_backends(CudaPlatform, cuda_config(SM90), backends={})
    providers = {
        "FLASH_ATTN": "kvloom-backend-flash-attn",
        "FLASHINFER": "kvloom-backend-flashinfer",
        "TRITON_ATTN": "kvloom-backend-triton",
        "FLEX_ATTENTION": "kvloom-backend-flex-attention",
    }
    for c in report.candidates:
        assert not c.valid and not c.installed and c.version is None
        assert c.distribution == providers[c.name]
        assert c.reasons == (f"not installed (pip install {providers[c.name]})",)
    assert report.selected is None and report.error is not None


@pytest.mark.parametrize(
    ("capability", "expected"), [(SM80, "TRITON_ATTN"), (SM90, "TRITON_ATTN"), (SM100, "FLASHINFER"), (SM75, "TRITON_ATTN")]
)
def test_first_valid_in_priority_order(capability: DeviceCapability, expected: str) -> None:
    dtype = torch.float16 if capability == SM75 else torch.bfloat16  # Turing has no bf16
    result = select_attention_backend(CudaPlatform, cuda_config(capability, dtype=dtype), backends=ALL_FAKES)
    assert result.selected.NAME == expected
    assert result.block_size == 16
    if capability == SM75:  # Turing: FlashAttention needs SM 8.0
        assert result.candidates[1].reasons == ("compute capability 7.5 not supported (supports 8.0..any)",)
    # Without TRITON_ATTN, FLASH_ATTN is next on Ampere/Hopper.
    if capability in (SM80, SM90):
        others = entries(*[b for b in STANDARD_FAKES if b.NAME != "TRITON_ATTN"])
        assert select_attention_backend(CudaPlatform, cuda_config(capability), backends=others).selected.NAME == "FLASH_ATTN"


def test_bfloat16_on_turing_is_refused_by_every_backend() -> None:
    with pytest.raises(BackendSelectionError) as err:
        select_attention_backend(CudaPlatform, cuda_config(SM75), backends=ALL_FAKES)
    assert "TRITON_ATTN (kvloom-backend-triton): dtype bfloat16 needs compute capability >= 8.0 (device has 7.5)" in str(err.value)


def test_float32_falls_through_to_triton() -> None:
    result = select_attention_backend(CudaPlatform, cuda_config(SM100, dtype=torch.float32), backends=ALL_FAKES)
    assert result.selected.NAME == "TRITON_ATTN"
    for invalid in result.candidates[:2]:
        assert invalid.reasons == ("dtype float32 not supported (supports float16, bfloat16)",)


def test_blackwell_head_size_96_skips_flashinfer() -> None:
    result = select_attention_backend(CudaPlatform, cuda_config(SM100, head_size=96), backends=ALL_FAKES)
    assert result.selected.NAME == "FLASH_ATTN"
    assert result.candidates[0].reasons == ("head size 96 not supported (supports 64, 128, 256)",)


def test_user_block_size_is_validated() -> None:
    result = select_attention_backend(CudaPlatform, cuda_config(SM90, block_size=8), backends=ALL_FAKES)
    assert result.selected.NAME == "FLEX_ATTENTION"  # the only one accepting 8
    assert result.block_size == 8
    assert result.candidates[0].reasons == ("block size 8 not supported (supports multiples of 16)",)


def test_mla_selection_and_block_size_negotiation() -> None:
    blackwell = select_attention_backend(CudaPlatform, cuda_config(SM100, use_mla=True, head_size=576), backends=ALL_FAKES)
    assert blackwell.selected.NAME == "FLASHINFER_MLA"
    assert blackwell.block_size == 32  # 16 is not supported: its first declared size
    forced_128 = select_attention_backend(
        CudaPlatform, cuda_config(SM100, use_mla=True, head_size=576, block_size=128), backends=ALL_FAKES
    )
    assert forced_128.selected.NAME == "CUTLASS_MLA"
    hopper = select_attention_backend(CudaPlatform, cuda_config(SM90, use_mla=True, head_size=576), backends=ALL_FAKES)
    assert hopper.selected.NAME == "FLASH_ATTN_MLA"
    ampere = select_attention_backend(CudaPlatform, cuda_config(SM80, use_mla=True, head_size=576), backends=ALL_FAKES)
    assert ampere.selected.NAME == "TRITON_MLA"
    reasons = {c.name: c.reasons for c in ampere.candidates}
    assert reasons["FLASHMLA"] == ("compute capability 8.0 not supported (supports 9.0..10.9)",)
    assert reasons["FLASHMLA_SPARSE"][-1] == "sparse attention only (the model is not sparse)"
    # Standard backends are candidates too (installed, not listed) and say why not.
    assert reasons["FLASH_ATTN"] == ("head size 576 not supported (supports 1..256)", "MLA not supported")


def test_requested_invalid_backend_raises_with_reasons_and_never_falls_back() -> None:
    # The seed's example: FLASHMLA requested on a GPU it does not support.
    config = cuda_config(SM80, use_mla=True, head_size=576)
    with pytest.raises(ValueError) as e:
        select_attention_backend(CudaPlatform, config, requested="FLASHMLA", backends=ALL_FAKES)
    assert str(e.value) == (
        "Selected backend FLASHMLA is not valid for this configuration. "
        "Reasons: ['compute capability 8.0 not supported (supports 9.0..10.9)']"
    )
    with pytest.raises(BackendSelectionError) as e:
        select_attention_backend(
            CudaPlatform, cuda_config(SM90, dtype=torch.float32, head_size=80), requested="FLASHINFER", backends=ALL_FAKES
        )
    assert "Reasons: ['dtype float32 not supported (supports float16, bfloat16)', " in str(e.value)
    assert "'head size 80 not supported (supports 64, 128, 256)']" in str(e.value)


def test_requested_valid_backend_wins_over_priority() -> None:
    result = select_attention_backend(CudaPlatform, cuda_config(SM90), requested="FLEX_ATTENTION", backends=ALL_FAKES)
    assert result.selected.NAME == "FLEX_ATTENTION"
    assert result.candidates[0].valid  # FLASH_ATTN was valid but not requested


def test_unknown_requested_name_lists_valid_names() -> None:
    with pytest.raises(ValueError) as e:
        select_attention_backend(CudaPlatform, cuda_config(SM90), requested="FLASH_ATTENTION", backends=entries(*STANDARD_FAKES))
    assert str(e.value) == (
        "Unknown attention backend 'FLASH_ATTENTION'. "
        "Valid names: FLASHINFER, FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN."
    )
    with pytest.raises(ValueError) as e:
        select_attention_backend(CudaPlatform, cuda_config(SM90), requested="FLASHINFER", backends=entries(STANDARD_FAKES[0]))
    assert "FLASHINFER is not installed (pip install kvloom-backend-flashinfer). Valid names: FLASH_ATTN." in str(e.value)


def test_no_valid_backend_lists_every_candidate_and_reason() -> None:
    config = cuda_config(SM90, head_size=512, dtype=torch.float32)
    with pytest.raises(BackendSelectionError) as e:
        select_attention_backend(CudaPlatform, config, backends=entries(*STANDARD_FAKES[:3]))
    lines = str(e.value).splitlines()
    assert lines[0].startswith("No valid attention backend found for platform cuda (device cuda, capability 9.0): ")
    assert "head_size=512, dtype=float32" in lines[0]
    assert lines[1:] == [
        "  1. TRITON_ATTN (kvloom-backend-triton): head size 512 not supported (supports 1..256)",
        "  2. FLASH_ATTN (kvloom-backend-flash-attn): dtype float32 not supported (supports float16, bfloat16); "
        "head size 512 not supported (supports 1..256)",
        "  3. FLASHINFER (kvloom-backend-flashinfer): dtype float32 not supported (supports float16, bfloat16); "
        "head size 512 not supported (supports 64, 128, 256)",
        "  4. FLEX_ATTENTION (kvloom-backend-flex-attention): not installed (pip install kvloom-backend-flex-attention)",
    ]


def test_out_of_tree_backends_rank_after_the_platform_list() -> None:
    big_heads = dict(supported_dtypes=ALL_DTYPES, max_head_size=1024, supported_block_sizes=ANY_BLOCK)
    oot_b = fake("OOT_B", "oot-b", **big_heads)
    oot_a = fake("OOT_A", "oot-a", **big_heads)
    backends = entries(*STANDARD_FAKES, oot_b, oot_a)
    result = select_attention_backend(CudaPlatform, cuda_config(SM90), backends=backends)
    assert [c.name for c in result.candidates] == STANDARD_AMPERE_HOPPER + ["OOT_A", "OOT_B"]
    assert result.selected.NAME == "TRITON_ATTN"  # a valid listed backend outranks them
    # Nothing listed supports head size 512: the first valid out-of-tree backend wins.
    result = select_attention_backend(CudaPlatform, cuda_config(SM90, head_size=512), backends=backends)
    assert result.selected.NAME == "OOT_A"
    assert (result.candidates[4].distribution, result.candidates[4].version) == ("oot-a", "0.0.test")
    # ...and each can be selected by NAME.
    chosen = select_attention_backend(CudaPlatform, cuda_config(SM90), requested="OOT_B", backends=backends)
    assert chosen.selected is oot_b


def test_backends_for_other_devices_are_invalid_candidates() -> None:
    # On the CPU platform the CUDA backends are candidates (installed, not listed) that
    # say why they cannot run; CPU_ATTN is not installed in this test.
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    report = report_attention_backends(CpuPlatform, config, backends=entries(*STANDARD_FAKES))
    reasons = {c.name: c.reasons for c in report.candidates}
    assert reasons["CPU_ATTN"] == ("not installed (pip install kvloom-backend-cpu)",)
    assert reasons["TRITON_ATTN"] == ("device type cpu not supported (supports cuda)",)
    assert report.selected is None and "No valid attention backend found for platform cpu" in report.error


def test_excluded_backends_say_kvloom_plugins_left_them_out() -> None:
    installed = entries(*[b for b in STANDARD_FAKES if b.NAME != "TRITON_ATTN"])
    excluded = [entries(STANDARD_FAKES[2])["TRITON_ATTN"]]
    result = select_backend(CudaPlatform, cuda_config(SM90), None, installed, excluded)
    first = result.candidates[0]
    assert (first.name, first.status, first.reasons) == (
        "TRITON_ATTN",
        "excluded",
        ("installed (kvloom-backend-triton 0.0.test) but KVLOOM_PLUGINS does not list it",),
    )
    assert result.selected.NAME == "FLASH_ATTN"


def test_report_never_raises_on_selection_errors_and_has_the_json_shape() -> None:
    report = report_attention_backends(CudaPlatform, cuda_config(SM90), requested="FLASHMLA", backends=ALL_FAKES)
    assert report.selected is None and report.error.startswith("Selected backend FLASHMLA is not valid")
    data = report.to_json()
    assert set(data) == {"platform", "selected", "candidates", "block_size", "order", "tune_created"}
    assert (data["order"], data["tune_created"]) == ("platform", None)
    assert all(set(c) == {"name", "priority", "valid", "reasons", "distribution", "version", "measured_ms"}
               for c in data["candidates"])  # fmt: skip
    ok = report_attention_backends(CudaPlatform, cuda_config(SM100), backends=ALL_FAKES)
    assert (ok.selected, ok.block_size, ok.error) == ("FLASHINFER", 16, None)


def test_a_crashing_validate_configuration_is_a_plugin_error() -> None:
    class Crashing(FakeBackend):
        NAME = "CRASHING"
        supported_device_types = ("cuda",)

        @classmethod
        def extra_validation(cls, config: AttentionSelectorConfig) -> list[str]:
            raise ZeroDivisionError("bug in plugin")

    with pytest.raises(PluginLoadError, match="CRASHING.*validate_configuration raised ZeroDivisionError"):
        select_attention_backend(CudaPlatform, cuda_config(SM90), backends=entries(Crashing))
