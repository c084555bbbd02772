"""kvloom.interfaces.k_splits: the split-K plan the quantization plugins' GEMMs share."""

from __future__ import annotations

import torch

from kvloom.interfaces import k_splits

CPU = torch.device("cpu")  # counts 8 multiprocessors (Triton's interpreter)


def test_splits_until_the_grid_covers_the_device_waves_times():
    assert k_splits(2, 100, CPU) == 8  # 2 tiles x 8 splits = 16 programs = 2 waves of 8
    assert k_splits(2, 100, CPU, waves=1) == 4
    assert k_splits(3, 100, CPU) == 6  # ceil(16 / 3)


def test_never_more_splits_than_k_tiles_nor_fewer_than_one():
    assert k_splits(1, 3, CPU) == 3
    assert k_splits(64, 100, CPU) == 1  # the tiles alone fill it
