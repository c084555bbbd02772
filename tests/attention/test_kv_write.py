"""The torch KV-cache writes used by several backends: correct, and free of host syncs
(they run inside captured CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from kvloom.attention.kv_write import copy_rows_skipping_invalid, write_kv_default_layout
from kvloom.testing.host_sync import HostSyncError, no_host_sync


def test_the_detector_catches_item_and_zero_dim_indexing():
    t = torch.arange(5)
    with pytest.raises(HostSyncError):
        with no_host_sync():
            t[t.argmax()]  # a 0-dim index becomes a host integer
    with pytest.raises(HostSyncError):
        with no_host_sync():
            t.sum().item()


@pytest.mark.parametrize("slots", [[3, -1, 0, 7], [-1, -1], [5]])
def test_default_layout_write_matches_a_loop_and_never_syncs(slots):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 4, 2, 3, 8, generator=g)  # 4 blocks of 2 slots
    expected = cache.clone()
    key = torch.randn(len(slots), 3, 8, generator=g)
    value = torch.randn(len(slots), 3, 8, generator=g)
    for i, s in enumerate(slots):
        if s >= 0:
            expected[0].view(-1, 3, 8)[s] = key[i]
            expected[1].view(-1, 3, 8)[s] = value[i]
    with no_host_sync():
        write_kv_default_layout(cache, key, value, torch.tensor(slots))
    assert torch.equal(cache, expected)


def test_row_copy_never_syncs():
    dest = torch.zeros(6, 2)
    with no_host_sync():
        copy_rows_skipping_invalid(dest, torch.tensor([4, -1]), torch.ones(2, 2), torch.tensor([True, False]))
    assert dest[4].tolist() == [1.0, 1.0] and dest.sum().item() == 2.0


def test_flashinfer_paged_write_never_syncs(monkeypatch):
    # kvloom-backend-flashinfer depends on flashinfer (GPU-only), so CPU test envs import
    # its pure-torch parts from the source tree.
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "backends" / "flashinfer"))
    from kvloom_backend_flashinfer.kv_write import write_kv_nhd_paired

    cache = torch.zeros(3, 2, 4, 2, 8)
    with no_host_sync():
        write_kv_nhd_paired(cache, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0), torch.tensor([5, -1]))
    assert cache[1, 0, 1].eq(1).all() and cache[1, 1, 1].eq(2).all() and cache.sum().item() == 16 + 32
