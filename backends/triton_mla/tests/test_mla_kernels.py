"""Host-side parts of the MLA kernels on the CPU: split planning, config, argument checks."""

from __future__ import annotations

import pytest
import torch
from kvloom_backend_triton_mla import ops


def test_split_plan_fills_one_wave_and_respects_limits() -> None:
    cfg = ops.MLAKernelConfig()  # 2 programs per SM, >= 128 positions per split, <= 64 splits
    # 132 SMs hold 264 programs. 64 requests x 1 head tile (16 heads): 4 splits (a fifth
    # would start a second, mostly idle wave).
    assert ops.plan_num_kv_splits(64, 16, 4096, 132, cfg) == 4
    assert ops.plan_num_kv_splits(16, 16, 4096, 132, cfg) == 16
    assert ops.plan_num_kv_splits(256, 16, 4096, 132, cfg) == 1
    # 128 heads are 8 head tiles per request: 16 requests already give 128 programs.
    assert ops.plan_num_kv_splits(16, 128, 65536, 132, cfg) == 2
    # One request: limited by the split length (4096 / 128), then by max_splits.
    assert ops.plan_num_kv_splits(1, 16, 4096, 132, cfg) == 32
    assert ops.plan_num_kv_splits(1, 16, 100_000, 132, cfg) == 64
    assert ops.plan_num_kv_splits(3, 16, 10, 132, cfg) == 1
    assert ops.plan_num_kv_splits(1000, 16, 4096, 132, cfg) == 1
    forced = ops.MLAKernelConfig(force_num_splits=5)
    assert ops.plan_num_kv_splits(256, 16, 10, 132, forced) == 5


def test_config_overrides_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_VAR, "decode_block_n=64, force_num_splits=3")
    cfg = ops.resolve_config(torch.bfloat16, {"decode_num_warps": 8})
    assert (cfg.decode_block_n, cfg.force_num_splits, cfg.decode_num_warps) == (64, 3, 8)
    with pytest.raises(ValueError, match="decode_block_n=24"):
        ops.MLAKernelConfig(decode_block_n=24)
    monkeypatch.setenv(ops.ENV_VAR, "nonsense=1")
    with pytest.raises(ValueError, match="nonsense"):
        ops.resolve_config(torch.bfloat16)


def test_decode_rejects_mismatched_shapes() -> None:
    cfg = ops.MLAKernelConfig()
    q = torch.zeros(2, 4, 48)
    cache = torch.zeros(3, 16, 40)
    out = torch.zeros(2, 4, 32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache must be"):
        ops.mla_decode(q[..., :32], q[..., 32:], cache, bt, lens, out, 1.0, 1, cfg)
    cache = torch.zeros(3, 16, 48)
    with pytest.raises(ValueError, match="num_kv_splits"):
        ops.mla_decode(q[..., :32], q[..., 32:], cache, bt, lens, out, 1.0, 0, cfg)
    with pytest.raises(ValueError, match="dtypes must match"):
        ops.mla_decode(q[..., :32], q[..., 32:], cache.half(), bt, lens, out, 1.0, 1, cfg)
    with pytest.raises(ValueError, match="workspace"):
        ops.mla_decode(q[..., :32], q[..., 32:], cache, bt, lens, out, 1.0, 3, cfg,
                       *ops.decode_workspace(2, 4, 32, 2, "cpu"))
