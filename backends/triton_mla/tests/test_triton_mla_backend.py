"""TRITON_MLA declarations, validation and the builder's planning rules (no kernel launch;
test_mla_kernels_interpret.py runs the kernels, also through this backend's builder/impl)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from kvloom_backend_triton_mla.backend import TritonMLABackend
from kvloom_backend_triton_mla.builder import CONFIG_EXTRA_KEY, NUM_SMS_EXTRA_KEY, TritonMLAMetadataBuilder

from kvloom.interfaces import (
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
    DeviceCapability,
    MLADims,
)

H100 = DeviceCapability(9, 0)
DIMS = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _config(**overrides: object) -> AttentionSelectorConfig:
    base = dict(head_size=576, dtype=torch.bfloat16, block_size=64, device_type="cuda", device_capability=H100,
                num_heads=16, num_kv_heads=1, use_mla=True, mla_phase="decode")
    base.update(overrides)
    return AttentionSelectorConfig(**base)  # type: ignore[arg-type]


def _spec(phase: str = "decode", max_num_seqs: int = 64, **extra: object) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=16, num_kv_heads=1 if phase == "decode" else 16, head_size=576 if phase == "decode" else 192,
        dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, block_size=64, max_num_seqs=max_num_seqs,
        max_model_len=4096, scale=192**-0.5,
        extra={**DIMS.to_extra(), "mla_phase": phase, NUM_SMS_EXTRA_KEY: 132, **extra},
    )


def _decode_common(seq_lens: list[int]) -> CommonAttentionMetadata:
    b = len(seq_lens)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=lens, block_table=torch.zeros(b, 64, dtype=torch.int32),
        slot_mapping=torch.zeros(b, dtype=torch.int64), num_reqs=b, num_actual_tokens=b, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    )


def test_entry_point_and_declarations() -> None:
    (ep,) = [e for e in entry_points(group="kvloom.attention_backends") if e.name == "TRITON_MLA"]
    assert ep.load() is TritonMLABackend
    assert importlib.import_module(ep.module).KVLOOM_PLUGIN_API == "1.1"
    assert TritonMLABackend.is_mla and TritonMLABackend.mla_phases == ("decode", "prefill")
    assert TritonMLABackend.cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert TritonMLABackend.preferred_block_size() == 16
    assert TritonMLABackend.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)


def test_backend_module_does_not_import_triton() -> None:
    code = ("import sys; import kvloom_backend_triton_mla.backend; "
            "print(any(m == 'triton' or m.startswith('triton.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("phase,head_size", [("decode", 576), ("prefill", 192)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 64, 100])
def test_valid_on_hopper(phase: str, head_size: int, dtype: torch.dtype, block_size: int) -> None:
    assert TritonMLABackend.validate_configuration(
        _config(mla_phase=phase, head_size=head_size, dtype=dtype, block_size=block_size)) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"device_type": "cpu", "device_capability": None}, "device type cpu not supported"),
        ({"use_mla": False, "mla_phase": None, "head_size": 128}, "only MLA models"),
        ({"device_capability": DeviceCapability(7, 5)}, "compute capability"),
    ],
)
def test_invalid_configurations_name_the_reason(overrides: dict, expected: str) -> None:
    reasons = TritonMLABackend.validate_configuration(_config(**overrides))
    assert any(expected in r for r in reasons), reasons


def test_decode_plan_and_workspace() -> None:
    builder = TritonMLAMetadataBuilder(_spec(), torch.device("cpu"), 64)
    one = builder.build(_decode_common([4096]))
    assert one.num_kv_splits == 32  # >= 128 positions per split
    assert one.partial_out.shape == (1, 16, 32, 512) and one.partial_lse.shape == (1, 16, 32)
    many = builder.build(_decode_common([4096] * 64))
    assert many.num_kv_splits == 4 and many.partial_out.shape == (64, 16, 4, 512)  # one wave of 264
    short = builder.build(_decode_common([3, 100]))
    assert short.num_kv_splits == 1 and short.partial_out is None


def test_cudagraph_plan_depends_only_on_batch_size() -> None:
    builder = TritonMLAMetadataBuilder(_spec(), torch.device("cpu"), 64)
    a = builder.build_for_cudagraph_capture(_decode_common([5, 7]))
    b = builder.build_for_cudagraph_capture(_decode_common([4000, 1]))
    assert a.num_kv_splits == b.num_kv_splits > 1  # planned from max_model_len 4096
    assert a.partial_out.data_ptr() == b.partial_out.data_ptr()
    # Every batch size up to max_num_seqs fits the workspace allocated up front.
    for n in range(1, 65):
        builder.build_for_cudagraph_capture(_decode_common([4096] * n))
    assert not builder._retired


def test_cudagraph_batch_beyond_the_workspace_is_an_error() -> None:
    builder = TritonMLAMetadataBuilder(_spec(max_num_seqs=2, **{CONFIG_EXTRA_KEY: {"force_num_splits": 4}}),
                                       torch.device("cpu"), 64)
    with pytest.raises(ValueError, match="exceeds the decode workspace"):
        builder.build_for_cudagraph_capture(_decode_common([10] * 3))
    # Eagerly the workspace grows instead.
    assert builder.build(_decode_common([10] * 3)).partial_out.shape == (3, 16, 4, 512)


def test_prefill_metadata_counts_whole_sequences() -> None:
    builder = TritonMLAMetadataBuilder(_spec("prefill"), torch.device("cpu"), 64)
    qsl = torch.tensor([0, 5, 6, 26], dtype=torch.int32)
    lens = torch.tensor([30, 1, 20], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=lens, block_table=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(26, dtype=torch.int64), num_reqs=3, num_actual_tokens=26, max_query_len=20,
        max_seq_len=30, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    )
    md = builder.build(common)
    assert md.cu_seqlens_k.tolist() == [0, 30, 31, 51] and md.cu_seqlens_q.tolist() == [0, 5, 6, 26]
    assert md.max_query_len == 20
