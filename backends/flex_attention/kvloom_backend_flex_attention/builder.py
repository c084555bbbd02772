"""The FLEX_ATTENTION metadata builder: plans the step's query groups on the host.

All arrays come from ``query_start_loc_cpu``/``seq_lens_cpu`` (see ``planning.py``) and
are copied to the device once per step; the block masks are assembled on the device by
the first layer (``FlexAttentionMetadata.block_masks``). Not CUDA-graph capturable: the
number of padded query rows, hence the tensor shapes, changes from step to step.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import AttentionMetadataBuilder, CommonAttentionMetadata
from kvloom_backend_flex_attention.metadata import FlexAttentionMetadata, FlexQueryGroup
from kvloom_backend_flex_attention.planning import PageOwnership, plan_page_ownership, plan_query_groups


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        num_reqs = common.num_reqs
        block_size = self.spec.block_size
        seq_lens = common.seq_lens_cpu[:num_reqs]
        block_table = common.block_table[:num_reqs]
        window = self.spec.sliding_window
        plans = plan_query_groups(common.query_start_loc_cpu[: num_reqs + 1], seq_lens, block_size, window)
        ownership = plan_page_ownership(seq_lens, block_size, block_table.shape[1])

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        groups = [
            FlexQueryGroup(
                q_block_size=p.q_block_size,
                num_rows=p.num_rows,
                token_index=to_device(p.token_index),
                row_of_token=to_device(p.row_of_token),
                req_of_row=to_device(p.req_of_row),
                pos_of_row=to_device(p.pos_of_row),
                req_of_qblock=to_device(p.req_of_qblock),
                first_pages=to_device(p.first_pages),
                full_pages=to_device(p.full_pages),
                visible_pages=to_device(p.visible_pages),
            )
            for p in plans
        ]
        return FlexAttentionMetadata(
            groups=groups,
            block_table=block_table,
            ownership=PageOwnership(to_device(ownership.table_index), to_device(ownership.logical_page)),
            block_size=block_size,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            sliding_window=window,
        )
