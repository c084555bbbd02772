"""Logits processor plugins in the sampler: one batched call per processor with the rows
that asked for it (``extra_args``), after the built-in processing; the other rows untouched;
bad arguments and unknown names refused naming the key; a processor that returns the wrong
shape is an error the runner turns into its requests' failure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvloom.logits_processor import LogitsProcessor, LogitsProcessorRow
from kvloom.sample import logits_processors as lp
from kvloom.sample.metadata import SamplingMetadata, check_sampling_state
from kvloom.sample.sampler import Sampler
from kvloom.sampling_params import SamplingParams

VOCAB = 10


class Favour(LogitsProcessor):
    """``{"favour": token}``: that token wins. Records each call's rows."""

    name = "favour"
    calls: list[list[Any]] = []

    @classmethod
    def parse_args(cls, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("must be a token id")
        return value

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsProcessorRow]) -> torch.Tensor:
        Favour.calls.append([(r.args, list(r.output_token_ids)) for r in rows])
        for i, row in enumerate(rows):
            logits[i, row.args] = 1e9
        return logits


class Broken(Favour):
    name = "broken"

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsProcessorRow]) -> torch.Tensor:
        return logits[:, :3]


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lp, "available_logits_processors", lambda: {"favour": Favour, "broken": Broken})
    Favour.calls = []


def sample(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[int]:
    outputs = outputs or [[] for _ in params]
    meta = SamplingMetadata.build(params, [[1, 2]] * len(params), outputs, {}, VOCAB, "cpu", [None] * len(params))
    sampler = Sampler(lp.make_logits_processors(VOCAB, "cpu"))
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(len(params), 1)  # argmax: the last token
    return sampler(logits, meta).sampled_token_ids.tolist()


def test_the_rows_that_asked_in_one_call() -> None:
    params = [SamplingParams(temperature=0, extra_args={"favour": 3}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, extra_args={"favour": 5})]  # fmt: skip
    assert sample(params, [[7], [8], [9, -1]]) == [3, 9, 5]
    assert Favour.calls == [[(3, [7]), (5, [9, -1])]]


def test_bad_args_and_unknown_names_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="extra_args.favour: must be a token id"):
        lp.parse_extra_args({"favour": "x"})
    with pytest.raises(ValueError, match=r"extra_args.favor: no logits processor named 'favor' is loaded \(loaded: "
                                         r"broken, favour"):  # fmt: skip
        lp.parse_extra_args({"favor": 1})
    with pytest.raises(ValueError, match="extra_args.favour: must be a token id"):  # the engine core refuses it too
        check_sampling_state(SamplingParams(extra_args={"favour": "x"}), [1], VOCAB, None)


def test_a_processor_of_the_wrong_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="logits processor 'broken' returned logits of shape"):
        sample([SamplingParams(temperature=0, extra_args={"broken": 1})])


def test_the_server_refuses_bad_vllm_xargs() -> None:
    from kvloom.entrypoints.openai.protocol import CompletionRequest

    with pytest.raises(ValueError, match="vllm_xargs\n.*favour: must be a token id"):
        CompletionRequest.model_validate({"prompt": "hi", "vllm_xargs": {"favour": "x"}})
    request = CompletionRequest.model_validate({"prompt": "hi", "vllm_xargs": {"favour": 2}})
    assert request.sampling_values(4, None, None)["extra_args"] == {"favour": 2}
