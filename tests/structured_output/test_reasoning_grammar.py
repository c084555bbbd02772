"""A structured output's grammar with a reasoning parser (vLLM's ``enable_in_reasoning``
semantics): the reasoning is free (every token allowed, the matcher sees none of it), the
answer after ``</think>`` follows the grammar; a prompt that closes the reasoning, or
``enable_in_reasoning``, binds the whole output; an output that may open the reasoning
(qwen3) samples its first token from the grammar's tokens plus ``<think>``. Real xgrammar
on a byte-level tokenizer with the two marker tokens; a stand-in runner plays scripted
tokens, then samples among the tokens the step's bitmask allows (synchronous and async
scheduling)."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from kvloom.outputs import ModelRunnerOutput
from kvloom.request import FinishReason, Request
from kvloom.sampling_params import SamplingParams, StructuredOutputsParams
from kvloom.scheduler.scheduler import Scheduler
from kvloom.structured_output.bitmask import allowed_mask
from kvloom.structured_output.manager import StructuredOutputManager
from kvloom.testing.models import build_tokenizer
from tests.helpers.fake_model import make_configs

PATTERN = "[a-z]{5}"


@functools.lru_cache(maxsize=None)
def tokenizer():
    tok = build_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    return tok


def ids(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


THINK, END = ids("<think>")[0], ids("</think>")[0]


def make(parser: str | None, enable_in_reasoning: bool = False, async_scheduling: bool = False) -> Scheduler:
    tok = tokenizer()
    manager = StructuredOutputManager("xgrammar", len(tok), tokenizer_loader=lambda: tok, reasoning_parser=parser,
                                      enable_in_reasoning=enable_in_reasoning)  # fmt: skip
    sc, cc = make_configs(max_model_len=128)
    scheduler = Scheduler(sc, cc, num_blocks=64, structured_output_manager=manager)
    scheduler.async_scheduling = async_scheduling
    return scheduler


def add(scheduler: Scheduler, prompt: list[int], max_tokens: int = 30) -> Request:
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=PATTERN))
    request = Request("r", prompt, params)
    scheduler.add_request(request)
    scheduler.structured_output_manager.wait_for_compile(60)
    return request


def run(scheduler: Scheduler, script: list[int], pick: int = 0) -> tuple[list[int], list[torch.Tensor], object]:
    """Step until the request finishes: the scripted tokens first (whatever the mask says),
    then the ``pick``-th allowed token. Returns the output, each sampled token's allowed
    mask, and the finish reason. With async scheduling each step is scheduled before the
    previous one's token is applied, and a pending bitmask filled after (as the engine
    core does)."""
    vocab = len(tokenizer())
    output: list[int] = []
    masks: list[torch.Tensor] = []
    in_flight: tuple | None = None

    def apply(so, sampled) -> object:
        out = scheduler.update_from_output(so, ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                                                 sampled_token_ids=[sampled]))  # fmt: skip
        for o in out.outputs:
            output.extend(o.new_token_ids)
            if o.finish_reason is not None:
                return o.finish_reason
        return None

    for _ in range(200):
        so = scheduler.schedule()
        if in_flight is not None:
            finished = apply(*in_flight)
            in_flight = None
            if finished is not None:
                return output, masks, finished
        request = scheduler.requests["r"]
        sampled: list[int] = []
        if request.num_computed_tokens + so.num_scheduled_tokens["r"] >= request.num_tokens:  # samples this step
            rows, bitmask = so.structured_output_request_ids, so.grammar_bitmask
            if so.pending_structured_output_tokens:
                grammar = scheduler.get_grammar_bitmask(so)
                assert grammar is not None
                rows, bitmask = grammar.structured_output_request_ids, grammar.grammar_bitmask
            allowed = allowed_mask(bitmask[rows["r"] : rows["r"] + 1], vocab)[0]
            masks.append(allowed)
            k = len(masks) - 1
            sampled = [script[k] if k < len(script) else int(allowed.nonzero().flatten()[pick])]
        if scheduler.async_scheduling:
            in_flight = (so, sampled)
        else:
            finished = apply(so, sampled)
            if finished is not None:
                return output, masks, finished
    raise AssertionError("the request did not finish")


def answer_of(output: list[int]) -> str:
    return tokenizer().decode(output[output.index(END) + 1 :] if END in output else output, skip_special_tokens=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_reasoning_is_free_and_the_answer_follows_the_grammar(async_scheduling: bool) -> None:
    scheduler = make("deepseek_r1", async_scheduling=async_scheduling)
    add(scheduler, ids("Question?"))  # R1: the output starts inside the reasoning
    reasoning = ids("No RULES 42!")  # nothing the grammar allows
    output, masks, finish = run(scheduler, reasoning + [END])
    assert output[: len(reasoning) + 1] == reasoning + [END]
    assert all(bool(mask.all()) for mask in masks[: len(reasoning) + 1])  # every token allowed while reasoning
    assert not masks[len(reasoning) + 1].all()  # then the grammar's tokens only
    assert re.fullmatch(PATTERN, answer_of(output)) and finish == FinishReason.STOP
    assert not scheduler.structured_output_manager.gate._start  # freed with the request


def test_a_prompt_that_closes_the_reasoning_binds_the_whole_output() -> None:
    scheduler = make("qwen3")
    add(scheduler, ids("Q?<think></think>"))  # enable_thinking=False's empty block
    output, masks, finish = run(scheduler, [])
    assert not masks[0].all() and not masks[0][THINK]
    assert re.fullmatch(PATTERN, tokenizer().decode(output, skip_special_tokens=True)) and finish == FinishReason.STOP


def test_enable_in_reasoning_binds_the_reasoning_too() -> None:
    scheduler = make("deepseek_r1", enable_in_reasoning=True)
    add(scheduler, ids("Question?"))
    output, masks, _ = run(scheduler, [])
    assert not masks[0].all() and re.fullmatch(PATTERN, tokenizer().decode(output, skip_special_tokens=True))


@pytest.mark.parametrize("opens", [True, False])
def test_an_output_that_may_open_the_reasoning(opens: bool) -> None:
    """qwen3 without a marker in the prompt: the first token is the grammar's or <think>."""
    scheduler = make("qwen3")
    add(scheduler, ids("Question?"))
    if opens:
        output, masks, _ = run(scheduler, [THINK, *ids("ANY 1"), END])
        assert bool(masks[1].all())  # inside the reasoning now
        assert re.fullmatch(PATTERN, answer_of(output))
    else:
        output, masks, _ = run(scheduler, [])
        assert output[0] != THINK and re.fullmatch(PATTERN, tokenizer().decode(output, skip_special_tokens=True))
        assert not masks[1][THINK]  # only the first token may open the reasoning
    first = masks[0]  # the grammar's tokens and <think>
    assert first[THINK] and first[ids("a")[0]] and not first[ids("A")[0]]
