"""Random paged MLA decode batches and their float64 reference, for the decode kernel's
tests (interpreter and GPU) and benchmarks/bench_mla_decode.py.

The latent cache is NaN everywhere no request has a position, so a kernel that reads past
a sequence's end or through a wrong block-table entry produces NaN (infinite error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.testing.reference import attend, place_requests


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, H, L + R]
    kv_cache: torch.Tensor  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    kv_lora_rank: int
    scale: float

    def reference(self, rows: int | None = None) -> torch.Tensor:
        """float64 ``[rows, H, L]`` on the CPU for the first ``rows`` requests (default all):
        MQA of each query over its request's latent vectors (keys = the whole latent
        vector, values = its first L values)."""
        block_size = self.kv_cache.shape[1]
        cache = self.kv_cache.cpu()
        outs = []
        for b, seq_len in enumerate(self.seq_lens.tolist()[:rows]):
            pos = torch.arange(seq_len)
            latent = cache[self.block_table[b].cpu()[pos // block_size].long(), pos % block_size]
            outs.append(attend(self.q[b : b + 1].cpu(), latent[:, None, :], latent[:, None, : self.kv_lora_rank],
                               self.scale)[0])
        return torch.stack(outs)


def make_decode_case(
    seq_lens: list[int],
    *,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> DecodeCase:
    # Block placement on the host; values drawn on ``device`` (a benchmark's batch of 256 x
    # 4096 latent vectors is too slow to draw on the CPU and copy).
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)
    width = kv_lora_rank + rope_dim
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    requests = place_requests([1] * len(seq_lens), seq_lens, block_size=block_size, num_blocks=num_blocks,
                              generator=gen)
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype, device=device)
    max_blocks = max(len(r.blocks) for r in requests) + 1
    # Columns past a request's last block point at block 0: valid ids, never to be read.
    block_table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    slots = []
    for b, req in enumerate(requests):
        block_table[b, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        slots.append(req.slots(0, req.seq_len, block_size))
    all_slots = torch.cat(slots).to(device)
    cache.view(-1, width)[all_slots] = torch.randn(
        all_slots.shape[0], width, generator=values, device=device).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, width, generator=values, device=device)
    return DecodeCase(
        q=q.to(dtype),
        kv_cache=cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        kv_lora_rank=kv_lora_rank,
        scale=width**-0.5,
    )
