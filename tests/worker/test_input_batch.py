"""``InputBatch.append_placeholders`` / ``set_tokens``: the model runner's bookkeeping of
tokens sampled by a step whose results are still on their way to the host."""

from __future__ import annotations

import numpy as np

from kvloom.sampling_params import SamplingParams
from kvloom.worker.input_batch import InputBatch


def _batch() -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=8, max_blocks_per_req=2)
    batch.add("a", [1, 2, 3], [], SamplingParams(), None, ([0],), 3, None, None)
    batch.add("b", [4, 5], [6], SamplingParams(), None, ([1],), 3, None, None)
    return batch


def test_placeholders_are_appended_then_replaced_by_the_sampled_tokens():
    batch = _batch()
    a, b = batch["a"], batch["b"]
    placeholders = batch.append_placeholders([a, b])
    assert a.output_token_ids == [-1] and b.output_token_ids == [6, -1]
    assert batch.token_ids[a.row, :4].tolist() == [1, 2, 3, -1] and batch.token_ids[b.row, :4].tolist() == [4, 5, 6, -1]
    batch.set_tokens(placeholders, [10, 11])
    assert a.output_token_ids == [10] and b.output_token_ids == [6, 11]
    assert batch.token_ids[a.row, 3] == 10 and batch.token_ids[b.row, 3] == 11


def test_a_request_that_left_meanwhile_is_not_written_nor_is_its_rows_new_owner():
    batch = _batch()
    a, b = batch["a"], batch["b"]
    placeholders = batch.append_placeholders([a, b])
    batch.remove("a")
    c = batch.add("c", [7, 7, 7, 7], [], SamplingParams(), None, ([2],), 4, None, None)
    assert c.row == a.row  # the row is reused
    batch.set_tokens(placeholders, [10, 11])
    assert a.output_token_ids == [-1] and c.output_token_ids == []
    assert batch.token_ids[c.row, :4].tolist() == [7, 7, 7, 7]
    assert b.output_token_ids == [6, 11] and batch.token_ids[b.row, 3] == 11


def test_a_token_past_max_model_len_is_kept_in_the_list_only():
    batch = InputBatch(max_num_reqs=2, max_model_len=4, max_blocks_per_req=1)
    full = batch.add("full", [1, 2, 3], [4], SamplingParams(), None, ([0],), 3, None, None)
    before = batch.token_ids.copy()
    placeholders = batch.append_placeholders([full])
    batch.set_tokens(placeholders, [9])
    assert full.output_token_ids == [4, 9]
    assert np.array_equal(batch.token_ids, before)
