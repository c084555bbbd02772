"""InputProcessor: the ranges SamplingParams cannot check alone (those the model's
vocabulary bounds) and prompts that are not valid Unicode are ``ValueError``s naming the
field, raised when the request is added (``LLM.generate``, ``AsyncLLM``), before the
engine sees it."""

from __future__ import annotations

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.frontend import load_tokenizer
from kvloom.engine.input_processor import InputProcessor
from kvloom.inputs import RequestInput
from kvloom.sampling_params import SamplingParams
from tests.helpers.model_fixtures import tiny_model_dir

VOCAB = 512


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    config = create_engine_config(EngineArgs(model=str(tiny_model_dir("llama")), dtype="float32"))
    assert config.model.vocab_size == VOCAB
    return InputProcessor(config, load_tokenizer(config))


@pytest.mark.parametrize(
    "prompt,params,fragment",
    [
        ("hello", SamplingParams(top_k=VOCAB + 1), f"top_k: {VOCAB + 1} is out of range (allowed: -1 or 0 to disable "
                                                  f"top-k, else 1 <= top_k <= {VOCAB}"),
        ("hello", SamplingParams(stop_token_ids=[3, VOCAB]), f"stop_token_ids: token id {VOCAB} is out of range"),
        ("hello", SamplingParams(logit_bias={VOCAB: 1.0}), f"logit_bias: token id {VOCAB} is out of range"),
        ("caf\udce9", SamplingParams(), "prompt is not valid Unicode (lone UTF-16 surrogate \\udce9 at position 3)"),
        ({"prompt_token_ids": [1, VOCAB]}, SamplingParams(), f"token id {VOCAB} is out of range (allowed: 0..{VOCAB - 1})"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt: the prompt is empty"),
        ({"prompt_token_ids": [1, True]}, SamplingParams(), "prompt_token_ids: must be a list of integers"),
    ],
)
def test_bad_requests_are_value_errors_naming_the_field(processor, prompt, params, fragment) -> None:
    with pytest.raises(ValueError) as info:
        processor.process(RequestInput("r", prompt, params))
    assert fragment in str(info.value)


def test_limits_are_inclusive(processor) -> None:
    request, _ = processor.process(RequestInput("r", "hello", SamplingParams(top_k=VOCAB, stop_token_ids=[VOCAB - 1],
                                                                             logit_bias={0: -100.0})))  # fmt: skip
    assert request.sampling_params.top_k == VOCAB
