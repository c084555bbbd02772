"""Codes and group parameters (``formats.Decoded``) repacked into the kernels' tiles.

``kernels.c`` reads a weight ``[rows, cols]`` as tiles of 8 rows by blocks of 32 features:
``codes [tiles, blocks, code bytes]`` (``uint8``) and ``params [tiles, blocks, floats]``
(float32); its header comment gives the byte order of each format. Rows past the last
multiple of 8 are padding (codes and parameters 0); the GEMMs never write their outputs.
"""

from __future__ import annotations

import numpy as np
import torch

from kvloom_quant_gguf.formats import S8, U4, U8, Decoded

TILE = 8
BLOCK = 32


def _tiles(array: np.ndarray) -> np.ndarray:
    """``[rows, ...]`` padded with zero rows to a multiple of ``TILE``."""
    pad = -array.shape[0] % TILE
    return np.concatenate([array, np.zeros((pad, *array.shape[1:]), array.dtype)]) if pad else array


def pack(weight: Decoded) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, params)`` of ``weight`` in its kernel format."""
    codes = _tiles(weight.codes.view(np.uint8))
    rows, cols = codes.shape
    tiles, blocks = rows // TILE, cols // BLOCK
    scale = _tiles(weight.scale)
    if weight.fmt == U4:
        # [tile, row c, block, half, p, j] -> [tile, block, p, c, j, half]: byte p*32 + c*4 + j
        # holds feature 4p + j (low nibble) and 16 + 4p + j (high nibble).
        c = codes.reshape(tiles, TILE, blocks, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
        packed = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, blocks, 128)
        pieces = [scale, _tiles(weight.min)]  # type: ignore[arg-type]
        params = np.stack([p.reshape(tiles, TILE, blocks).transpose(0, 2, 1) for p in pieces], axis=2)
    else:
        # [tile, row c, block, p, j] -> [tile, block, p, c, j]: byte p*32 + c*4 + j is feature 4p + j.
        packed = codes.reshape(tiles, TILE, blocks, 8, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
        if weight.fmt == S8:
            params = scale.reshape(tiles, TILE, blocks).transpose(0, 2, 1)
        else:
            assert weight.fmt == U8
            pieces = [scale, _tiles(weight.min)]  # type: ignore[arg-type]
            # [tile, block, group, scale/min, c]
            params = np.stack([p.reshape(tiles, TILE, blocks, 2).transpose(0, 2, 3, 1) for p in pieces], axis=3)
    codes_t = torch.from_numpy(np.ascontiguousarray(packed))
    params_t = torch.from_numpy(np.ascontiguousarray(params, dtype=np.float32).reshape(tiles, blocks, -1))
    return codes_t, params_t
