"""Per-step metadata of the FLEX_ATTENTION backend (built by the builder, read by the impl)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvloom_backend_flex_attention.block_mask import (
    build_logical_of_page,
    build_paged_block_mask,
    paged_causal_mask_mod,
)
from kvloom_backend_flex_attention.planning import PageOwnership


@dataclass
class FlexQueryGroup:
    """Device copies of a ``QueryGroupPlan`` (see ``planning.py``)."""

    q_block_size: int
    num_rows: int
    token_index: torch.Tensor
    row_of_token: torch.Tensor
    req_of_row: torch.Tensor
    pos_of_row: torch.Tensor
    req_of_qblock: torch.Tensor
    first_pages: torch.Tensor
    full_pages: torch.Tensor
    visible_pages: torch.Tensor


@dataclass
class FlexAttentionMetadata:
    groups: list[FlexQueryGroup]
    block_table: torch.Tensor  # [B, W] on the device
    ownership: PageOwnership  # on the device
    block_size: int
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    #: The KV-cache group's sliding window (each layer checks that it has this one).
    sliding_window: int | None = None
    #: Block masks by cache size, built on the first layer's forward (the number of cache
    #: blocks is a property of the KV tensor the layers receive) and shared by the rest.
    _block_masks: dict[int, list[BlockMask]] = field(default_factory=dict, repr=False)

    def block_masks(self, num_blocks: int) -> list[BlockMask]:
        masks = self._block_masks.get(num_blocks)
        if masks is None:
            logical_of_page = build_logical_of_page(self.block_table, self.ownership, num_blocks)
            # flex's CPU kernel needs index lists covering the whole KV length.
            min_width = num_blocks if self.block_table.device.type == "cpu" else 0
            masks = [
                build_paged_block_mask(
                    q_block_size=g.q_block_size,
                    num_rows=g.num_rows,
                    req_of_qblock=g.req_of_qblock,
                    first_pages=g.first_pages,
                    full_pages=g.full_pages,
                    visible_pages=g.visible_pages,
                    block_table=self.block_table,
                    block_size=self.block_size,
                    num_blocks=num_blocks,
                    mask_mod=paged_causal_mask_mod(
                        g.req_of_row, g.pos_of_row, self.block_table, logical_of_page, self.block_size,
                        self.sliding_window,
                    ),
                    min_index_width=min_width,
                )
                for g in self.groups
            ]
            self._block_masks[num_blocks] = masks
        return masks
