"""Blocks as connectors move them: ``KVLayerCache`` gathers and scatters whole blocks of any
backend's layout, ``KVBlockFiles`` stores them bit for bit and refuses what is not a block
of its layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvloom.interfaces import KVBlockFileError, KVBlockFiles, KVLayerCache, block_key
from kvloom.kv_transfer.blocks import block_dim_of

LAYOUTS = {
    "(2, blocks, ...)": lambda n, b, h, d: (2, n, b, h, d),  # CPU, Triton, flex attention
    "(blocks, 2, ...)": lambda n, b, h, d: (n, 2, b, h, d),  # FlashInfer
    "MLA latent": lambda n, b, h, d: (n, b, d),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_exactly_the_blocks(layout: str, dtype: torch.dtype) -> None:
    shape_of = LAYOUTS[layout]
    dim = block_dim_of(shape_of, 16, 2, 8)
    g = torch.Generator().manual_seed(0)
    src = KVLayerCache("a", torch.randn(shape_of(10, 16, 2, 8), generator=g).to(dtype), dim)
    dst = KVLayerCache("a", torch.randn(shape_of(10, 16, 2, 8), generator=g).to(dtype), dim)
    before = dst.tensor.clone()
    blocks = src.gather(torch.tensor([7, 2, 5]))
    assert blocks.shape == (3, *src.block_shape) and src.num_blocks == 10
    assert src.block_nbytes == blocks[0].numel() * blocks.element_size()
    dst.scatter(torch.tensor([0, 9, 4]), blocks)
    for s, d in ((7, 0), (2, 9), (5, 4)):
        assert torch.equal(dst.tensor.select(dim, d), src.tensor.select(dim, s))
    for untouched in (1, 2, 3, 5, 6, 7, 8):
        assert torch.equal(dst.tensor.select(dim, untouched), before.select(dim, untouched))


def test_block_files_round_trip_bit_for_bit(tmp_path: Path) -> None:
    layout = [("torch.bfloat16", (2, 16, 2, 8)), ("torch.float32", (16, 40))]
    files = KVBlockFiles(tmp_path, layout)
    blocks = [torch.randn(2, 16, 2, 8).to(torch.bfloat16), torch.randn(16, 40)]
    blocks[1][0, 0] = float("nan")  # bytes, not values: NaN payloads come back too
    key = block_key(0, bytes(range(32)))
    assert not files.exists(key)
    written = files.write(key, blocks)
    assert written == sum(b.numel() * b.element_size() for b in blocks) and files.exists(key)
    out = [torch.empty_like(b) for b in blocks]
    assert files.read(key, out) == written
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(blocks, out))
    assert not list(files.path(key).parent.glob(".tmp-*"))  # written atomically: no temporary left


def test_a_file_of_another_layout_or_truncated_is_refused(tmp_path: Path) -> None:
    key = block_key(0, b"\x01" * 32)
    KVBlockFiles(tmp_path, [("torch.float32", (4,))]).write(key, [torch.ones(4)])
    with pytest.raises(KVBlockFileError, match="another KV layout"):
        KVBlockFiles(tmp_path, [("torch.float32", (5,))]).read(key, [torch.empty(5)])
    files = KVBlockFiles(tmp_path, [("torch.float32", (4,))])
    path = files.path(key)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(KVBlockFileError, match="truncated"):
        files.read(key, [torch.empty(4)])
    with pytest.raises(KVBlockFileError, match="cannot read"):
        files.read(block_key(0, b"\x02" * 32), [torch.empty(4)])
    path.write_bytes(b"garbage")
    with pytest.raises(KVBlockFileError, match="not a kvloom block file"):
        files.read(key, [torch.empty(4)])
    with pytest.raises(ValueError, match="do not match the store's layout"):
        files.write(key, [torch.ones(3)])
