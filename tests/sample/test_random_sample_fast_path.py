"""The sampler's ``random_sample`` fast path: taken exactly for plain temperature batches
(no logprobs, logit_bias, penalties, min_tokens, top-k/top-p/min-p, seeds; not all
greedy) when the platform's op is active, with the logits in their own dtype; every
other batch keeps the torch code, and ``random_sample_torch`` is that torch code."""

from __future__ import annotations

import pytest
import torch

from kvloom.layers.custom_ops import set_custom_ops
from kvloom.sample import Sampler, SamplingMetadata, make_generator
from kvloom.sample.sampler import random_sample_torch
from kvloom.sampling_params import SamplingParams

V = 32


def build(params: list[SamplingParams], outputs=None, generators=None, eos=None) -> SamplingMetadata:  # type: ignore[no-untyped-def]
    rows = len(params)
    return SamplingMetadata.build(params, [[1, 2, 3]] * rows, outputs or [[]] * rows, generators or {}, V, "cpu",
                                  eos or [None] * rows)  # fmt: skip


class RecordingOp:
    """A stand-in ``random_sample``: records its arguments, returns fixed token ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
        self.calls.append((logits, temperature, greedy))
        return torch.arange(logits.shape[0], dtype=torch.int64) + 7


@pytest.fixture
def op():  # type: ignore[no-untyped-def]
    recording = RecordingOp()
    set_custom_ops({"random_sample": recording})
    yield recording
    set_custom_ops({})


def logits_of(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    return (2 * torch.randn(rows, V, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_plain_temperature_batch_takes_the_op_with_the_logits_as_they_are(op: RecordingOp, dtype) -> None:  # type: ignore[no-untyped-def]
    logits = logits_of(3, dtype)
    meta = build([SamplingParams(temperature=0.6)] * 3)
    out = Sampler()(logits, meta)
    assert len(op.calls) == 1
    got_logits, temperature, greedy = op.calls[0]
    assert got_logits is logits  # no float32 copy first: the op reads the LM head's dtype
    assert temperature is meta.temperature and greedy is None
    assert out.sampled_token_ids.tolist() == [7, 8, 9]  # the op's result is the sampler's
    assert out.logprobs_tensors is None and out.num_logprobs == [None] * 3


def test_mixed_greedy_and_random_batch_passes_the_greedy_mask(op: RecordingOp) -> None:
    meta = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.9), SamplingParams(temperature=0.0)])
    out = Sampler()(logits_of(3), meta)
    assert len(op.calls) == 1
    _, temperature, greedy = op.calls[0]
    assert greedy is meta.greedy_mask and greedy.tolist() == [True, False, True]
    assert temperature.tolist() == pytest.approx([1.0, 0.9, 1.0])  # greedy rows hold 1.0
    assert out.sampled_token_ids.tolist() == [7, 8, 9]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param([SamplingParams(temperature=0.0)] * 2, id="all-greedy"),
        pytest.param([SamplingParams(temperature=0.7, top_k=5)] * 2, id="top_k"),
        pytest.param([SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9)], id="top_p"),
        pytest.param([SamplingParams(temperature=0.7, min_p=0.1)] * 2, id="min_p"),
        pytest.param([SamplingParams(temperature=0.7, logprobs=2), SamplingParams(temperature=0.7)], id="logprobs"),
        pytest.param([SamplingParams(temperature=0.0, logprobs=0)] * 2, id="greedy-logprobs"),
        pytest.param([SamplingParams(temperature=0.7, repetition_penalty=1.2)] * 2, id="repetition_penalty"),
        pytest.param([SamplingParams(temperature=0.7, presence_penalty=0.5)] * 2, id="presence_penalty"),
        pytest.param([SamplingParams(temperature=0.7, frequency_penalty=0.5)] * 2, id="frequency_penalty"),
        pytest.param([SamplingParams(temperature=0.7, logit_bias={3: 2.0})] * 2, id="logit_bias"),
        pytest.param([SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[4])] * 2, id="min_tokens"),
        pytest.param([SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=5)], id="seeded"),
    ],
)
def test_other_batches_keep_the_torch_code(op: RecordingOp, params: list[SamplingParams]) -> None:
    generators = {row: make_generator(p.seed, "cpu") for row, p in enumerate(params) if p.seed is not None}
    meta = build(params, outputs=[[4]] * len(params), generators=generators, eos=[4] * len(params))
    out = Sampler()(logits_of(len(params), torch.bfloat16), meta)
    assert op.calls == []
    assert out.sampled_token_ids.dtype == torch.int64 and bool((out.sampled_token_ids < V).all())


def test_without_the_op_plain_batches_keep_the_torch_code() -> None:
    """No active op (CPU platform, ``--custom-ops none``): the torch code, which is
    ``random_sample_torch``: same noise, same tokens."""
    set_custom_ops({})
    logits = logits_of(6, torch.bfloat16)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.5 + i / 4) for i in range(6)]
    meta = build(params)
    torch.manual_seed(3)
    sampler_tokens = Sampler()(logits, meta).sampled_token_ids
    torch.manual_seed(3)
    reference_tokens = random_sample_torch(logits, meta.temperature, meta.greedy_mask)
    assert torch.equal(sampler_tokens, reference_tokens)
    torch.manual_seed(3)
    all_random = build([SamplingParams(temperature=0.8)] * 6)
    sampled = Sampler()(logits, all_random).sampled_token_ids
    torch.manual_seed(3)
    assert torch.equal(sampled, random_sample_torch(logits, all_random.temperature, None))
