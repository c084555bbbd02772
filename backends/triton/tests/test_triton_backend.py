"""TRITON_ATTN declarations, validation, split planning, config and CUDA-graph rules.

Nothing here launches a kernel (see test_triton_backend_interpret.py for the kernels on
the CPU and test_triton_backend_compile.py for compiling them for a GPU target).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest
import torch
from kvloom_backend_triton.backend import TritonAttentionBackend
from kvloom_backend_triton.config import ENV_VAR, KernelConfig, default_config, parse_overrides, resolve_config

from kvloom.interfaces import (
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    CommonAttentionMetadata,
    DeviceCapability,
)

H100 = DeviceCapability(9, 0)


def _config(**overrides: object) -> AttentionSelectorConfig:
    base = dict(head_size=128, dtype=torch.bfloat16, block_size=16, device_type="cuda", device_capability=H100,
                num_heads=32, num_kv_heads=8)
    base.update(overrides)
    return AttentionSelectorConfig(**base)  # type: ignore[arg-type]


def test_entry_point_and_plugin_api() -> None:
    (ep,) = [e for e in entry_points(group="kvloom.attention_backends") if e.name == "TRITON_ATTN"]
    assert ep.load() is TritonAttentionBackend
    assert TritonAttentionBackend.NAME == "TRITON_ATTN"
    assert importlib.import_module(ep.module).KVLOOM_PLUGIN_API == "1.1"


def test_backend_module_does_not_import_triton_kernels() -> None:
    # The declarations must load where Triton is missing (a reason, not a crash).
    module = importlib.import_module("kvloom_backend_triton.backend")
    source = open(module.__file__).read()
    assert "import triton" not in source
    assert TritonAttentionBackend.required_modules == {"triton": "triton"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
def test_valid_on_cuda(dtype: torch.dtype, head_size: int, block_size: int) -> None:
    assert TritonAttentionBackend.validate_configuration(
        _config(dtype=dtype, head_size=head_size, block_size=block_size)
    ) == []


def test_cpu_device_is_rejected_for_the_device_type() -> None:
    reasons = TritonAttentionBackend.validate_configuration(_config(device_type="cpu", device_capability=None))
    assert reasons == ["device type cpu not supported (supports cuda)"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"block_size": 8}, "block size 8 not supported (supports multiples of 16)"),
        ({"block_size": 24}, "block size 24 not supported (supports multiples of 16)"),
        ({"head_size": 512}, "head size 512 not supported (supports 1..256)"),
        ({"kv_cache_dtype": "fp8"}, "kv cache dtype fp8 not supported (supports auto)"),
        ({"use_mla": True}, "MLA not supported"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type encoder_only not supported (supports decoder)"),
        ({"device_capability": DeviceCapability(6, 1), "dtype": torch.float16}, "compute capability 6.1 not supported (supports 7.0..any)"),
        (
            {"device_capability": DeviceCapability(7, 5)},
            "dtype bfloat16 needs compute capability >= 8.0 (device has 7.5); use float16",
        ),
    ],
)
def test_invalid_configurations_name_the_reason(overrides: dict, expected: str) -> None:
    assert TritonAttentionBackend.validate_configuration(_config(**overrides)) == [expected]


def test_fp16_on_turing_is_valid() -> None:
    cfg = _config(dtype=torch.float16, device_capability=DeviceCapability(7, 5))
    assert TritonAttentionBackend.validate_configuration(cfg) == []


def test_kv_cache_layout_and_split_views() -> None:
    shape = TritonAttentionBackend.get_kv_cache_shape(10, 16, 8, 128)
    assert shape == (2, 10, 16, 8, 128)
    cache = torch.randn(shape)
    k, v = TritonAttentionBackend.split_kv_cache(cache)
    assert k.shape == v.shape == (10, 16, 8, 128)
    assert k.stride(-1) == 1 and k.data_ptr() == cache.data_ptr()


def test_declared_cudagraph_support() -> None:
    assert TritonAttentionBackend.cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert TritonAttentionBackend.preferred_block_size() == 16


@pytest.mark.parametrize(
    ("field", "value"),
    [("sliding_window", 128), ("logits_soft_cap", 30.0), ("kv_cache_dtype", "fp8"), ("attn_type", AttentionType.ENCODER)],
)
def test_impl_rejects_unsupported_features(field: str, value: object) -> None:
    impl_cls = TritonAttentionBackend.get_impl_cls()
    with pytest.raises(NotImplementedError, match=field if field != "attn_type" else "attn_type"):
        impl_cls(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, **{field: value})


# ----------------------------------------------------------------------------- config


def test_heuristic_table_shrinks_tiles_for_large_heads_and_fp32() -> None:
    small, mid, big = (default_config(d, torch.bfloat16) for d in (64, 128, 256))
    assert big.prefill_block_m < mid.prefill_block_m and big.decode_block_n < mid.decode_block_n
    wide = default_config(128, torch.float32)
    assert wide.prefill_block_n < mid.prefill_block_n and wide.decode_block_n < mid.decode_block_n
    assert default_config(80, torch.float16) == mid  # padded to 128


def test_hopper_gets_the_wider_prefill_tile() -> None:
    # Before sm_90 (mma.sync, no wgmma) a 128 x 128 tile of a 128-dim head spills registers.
    assert default_config(128, torch.bfloat16, arch=90).prefill_block_n == 128
    assert default_config(128, torch.bfloat16, arch=80).prefill_block_n == 64
    assert default_config(128, torch.bfloat16) == default_config(128, torch.bfloat16, arch=80)
    assert resolve_config(128, torch.bfloat16, arch=90).prefill_block_n == 128


def test_env_and_explicit_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "decode_block_n=32, decode_num_warps=8,force_num_splits=none")
    cfg = resolve_config(128, torch.bfloat16, {"prefill_num_stages": 2})
    assert (cfg.decode_block_n, cfg.decode_num_warps, cfg.prefill_num_stages) == (32, 8, 2)
    assert cfg.force_num_splits is None
    explicit = KernelConfig(decode_block_n=128)
    assert resolve_config(128, torch.bfloat16, explicit) is explicit


@pytest.mark.parametrize(
    ("text", "message"),
    [("decode_blok_n=32", "bad entry"), ("decode_block_n", "bad entry"), ("decode_block_n=x", "not an integer")],
)
def test_bad_override_text_is_an_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_overrides(text)


@pytest.mark.parametrize(
    "overrides",
    [{"decode_block_n": 48}, {"prefill_num_warps": 3}, {"decode_num_stages": 0}, {"force_num_splits": 0}],
)
def test_bad_config_values_name_the_field(overrides: dict) -> None:
    (name,) = overrides
    with pytest.raises(ValueError, match=name):
        KernelConfig(**overrides)


# ---------------------------------------------------------------------- split planning


def test_split_plan_fills_the_gpu_for_the_benchmark_shape() -> None:
    from kvloom_backend_triton.ops import plan_decode_splits

    cfg = default_config(128, torch.bfloat16)
    splits = plan_decode_splits(64, 8, 4096, 132, cfg)
    assert 64 * 8 * splits >= 132 * cfg.programs_per_sm * 0.9
    # One long request: split up to the minimum split length.
    splits = plan_decode_splits(1, 8, 32768, 132, cfg)
    assert splits >= 32 and 32768 / splits >= cfg.min_split_tokens
    # Short contexts are never split below min_split_tokens.
    assert plan_decode_splits(1, 8, 100, 132, cfg) == 1


def test_split_plan_respects_max_splits_and_force() -> None:
    from kvloom_backend_triton.ops import plan_decode_splits

    cfg = KernelConfig(max_splits=4, min_split_tokens=16)
    assert plan_decode_splits(1, 1, 100_000, 132, cfg) <= 4
    forced = KernelConfig(force_num_splits=5, decode_block_n=16)
    assert plan_decode_splits(64, 8, 160, 132, forced) == 5
    # A split holds whole tiles: never more splits than tiles.
    assert plan_decode_splits(64, 8, 40, 132, forced) == 3


def _common(seq_lens: list[int], query_lens: list[int]) -> CommonAttentionMetadata:
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=sl, block_table=torch.zeros(len(seq_lens), 64, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.long), num_reqs=len(seq_lens), num_actual_tokens=n,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=sl,
    )


def _builder(max_num_seqs: int = 64, max_model_len: int = 8192, **extra: object):  # type: ignore[no-untyped-def]
    spec = AttentionLayerSpec(
        num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
        block_size=16, max_num_seqs=max_num_seqs, max_model_len=max_model_len, scale=128**-0.5,
        extra={"triton_attn_num_sms": 132, **extra},
    )
    return TritonAttentionBackend.get_builder_cls()(spec, torch.device("cpu"), 512)


def test_cudagraph_plan_depends_only_on_batch_size_and_limits() -> None:
    builder = _builder()
    plans = set()
    for lens in ([1] * 8, [5000, 20, 7, 1, 1, 300, 8191, 2], [100] * 8):
        md = builder.build_for_cudagraph_capture(_common(lens, [1] * 8))
        plans.add((md.num_splits, md.partial_out.data_ptr()))
        assert md.for_cudagraph and md.decode_only and not md.split_single
    assert len(plans) == 1
    # Eager plans follow the step's longest sequence instead: short ones split less.
    short = builder.build(_common([100] * 8, [1] * 8))
    long = builder.build(_common([8000] * 8, [1] * 8))
    assert short.num_splits == 1 < long.num_splits


def test_mixed_batch_plans_splits_for_its_single_token_requests() -> None:
    builder = _builder(max_num_seqs=64)
    md = builder.build(_common([4000] * 4 + [600], [1] * 4 + [512]))
    assert md.split_single and not md.decode_only
    # Four decodes x 8 KV heads: splits fill the GPU as a 4-request decode step's would.
    assert md.num_splits == builder.build(_common([4000] * 4, [1] * 4)).num_splits > 1
    assert md.num_reqs * md.num_splits <= md.partial_out.shape[0]
    # Prefills only: nothing for the decode kernel.
    md = builder.build(_common([600, 700], [512, 300]))
    assert not md.split_single and not md.decode_only


def test_mixed_batch_splits_stay_within_the_workspace() -> None:
    builder = _builder(max_num_seqs=64)
    rows = builder.partial_out.shape[0]
    # One long decode among 63 prefills: its plan wants many splits, the workspace (a row
    # per request and split) caps them rather than growing for rows nobody writes.
    md = builder.build(_common([8000] + [40] * 63, [1] + [20] * 63))
    assert md.split_single and 1 <= md.num_splits and 64 * md.num_splits <= rows
    assert builder.partial_out.shape[0] == rows


def test_workspace_covers_every_batch_up_to_max_num_seqs() -> None:
    builder = _builder(max_num_seqs=256, max_model_len=32768)
    rows = builder.partial_out.shape[0]
    ptr = builder.partial_out.data_ptr()
    for batch in range(1, 257):
        md = builder.build_for_cudagraph_capture(_common([1] * batch, [1] * batch))
        assert batch * md.num_splits <= rows
    assert builder.partial_out.data_ptr() == ptr


def test_mixed_batch_metadata_passes_runner_tensors_through() -> None:
    builder = _builder()
    common = _common([40, 7, 300], [10, 7, 1])
    md = builder.build(common)
    assert not md.decode_only and md.split_single  # the 300-token request decodes
    assert md.query_start_loc is common.query_start_loc and md.block_table is common.block_table
    assert md.seq_lens is common.seq_lens and md.slot_mapping is common.slot_mapping


def test_non_causal_metadata_is_rejected() -> None:
    common = _common([4], [4])
    common.causal = False
    with pytest.raises(ValueError, match="causal"):
        _builder().build(common)
