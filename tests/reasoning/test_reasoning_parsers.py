"""The reasoning parsers' splitter: streamed output, cut anywhere (inside the markers too),
adds up to the whole output's split; the two built-in parsers' rules; the token-id side the
engine core uses."""

from __future__ import annotations

import itertools

import pytest

from kvloom.reasoning.base import ReasoningParser, ReasoningState
from kvloom.reasoning.registry import get_reasoning_parser_cls

VOCAB = {"<think>": 7, "</think>": 8, "a": 1, "b": 2}
START, END = VOCAB["<think>"], VOCAB["</think>"]


class VocabTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return dict(VOCAB)


def parser(name: str) -> ReasoningParser:
    return get_reasoning_parser_cls(name)(VocabTokenizer())


def streamed(p: ReasoningParser, pieces: list[str], prompt: list[int] | None = None) -> tuple[str, str, bool]:
    splitter = p.stream(prompt)
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), splitter.reasoned


# (parser, output text, prompt ids, expected reasoning (None: none), expected content)
CASES = [
    ("deepseek_r1", "Let me think.</think>The answer", None, "Let me think.", "The answer"),
    ("deepseek_r1", "<think>\nhmm</think>\n\nok", None, "\nhmm", "\n\nok"),
    ("deepseek_r1", "still thinking <thi", None, "still thinking <thi", ""),
    ("deepseek_r1", "x</think>", [START], "x", ""),
    ("deepseek_r1", "no reasoning </think> here", [START, 1, END, 2], None, "no reasoning </think> here"),
    ("qwen3", "<think>abc</think>xyz", None, "abc", "xyz"),
    ("qwen3", "  <think>abc</think>xyz", None, "abc", "xyz"),
    ("qwen3", "plain answer", None, None, "plain answer"),
    ("qwen3", "<thing>not a marker</thing>", None, None, "<thing>not a marker</thing>"),
    ("qwen3", "<think>cut off by max_tokens</thi", None, "cut off by max_tokens</thi", ""),
    ("qwen3", "answer", [START, 1, END], None, "answer"),
    ("qwen3", "thought</think>answer", [2, START], "thought", "answer"),
    ("qwen3", "", None, None, ""),
    ("qwen3", "<", None, None, "<"),
]


@pytest.mark.parametrize("name,text,prompt,reasoning,content", CASES)
def test_whole_output(name: str, text: str, prompt: list[int] | None, reasoning: str | None, content: str) -> None:
    assert parser(name).extract_reasoning(text, prompt) == (reasoning, content)


@pytest.mark.parametrize("name,text,prompt,reasoning,content", CASES)
def test_every_cut_gives_the_whole_outputs_split(name: str, text: str, prompt: list[int] | None,
                                                 reasoning: str | None, content: str) -> None:  # fmt: skip
    p = parser(name)
    expected = (reasoning or "", content, reasoning is not None)
    cuts = range(len(text) + 1)
    for i, j in itertools.combinations_with_replacement(cuts, 2):  # every 3-piece cut, empty pieces too
        assert streamed(p, [text[:i], text[i:j], text[j:]], prompt) == expected, (i, j)
    assert streamed(p, list(text), prompt) == expected  # one character a delta


def test_held_back_text_is_only_a_possible_marker() -> None:
    """A stream sends everything that cannot be part of a marker at once."""
    splitter = parser("qwen3").stream()
    assert splitter.feed(" ").content == ""  # might still open with <think>
    assert splitter.feed("<thi").content == ""
    delta = splitter.feed("nk>I wonder</th")
    assert (delta.reasoning, delta.content) == ("I wonder", "")
    delta = splitter.feed("in")
    assert (delta.reasoning, delta.content) == ("", "")
    delta = splitter.feed("g?")  # not the end marker after all
    assert (delta.reasoning, delta.content) == ("</thing?", "")
    delta = splitter.feed("</think>Yes")
    assert (delta.reasoning, delta.content) == ("", "Yes") and splitter.reasoning_ended


def test_prompt_state_and_reasoning_end() -> None:
    r1, qwen3 = parser("deepseek_r1"), parser("qwen3")
    assert r1.prompt_state([1, 2]) is ReasoningState.REASONING
    assert qwen3.prompt_state([1, 2]) is ReasoningState.MAY_START
    assert qwen3.prompt_state([1, START, 2]) is ReasoningState.REASONING
    assert qwen3.prompt_state([START, 1, END, 2]) is ReasoningState.ENDED
    assert r1.prompt_state([END, 1, START]) is ReasoningState.REASONING
    assert qwen3.is_reasoning_end([START, 1, END]) and not qwen3.is_reasoning_end([END, START, 1])
    assert not qwen3.is_reasoning_end([1, 2])
    assert r1.reasoning_end_offset([1, 2]) is None
    assert r1.reasoning_end_offset([1, END]) == 2 and r1.reasoning_end_offset([END, 1, 2]) == 1


def test_a_tokenizer_without_the_markers_is_refused() -> None:
    class NoThink:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 1}

    with pytest.raises(ValueError, match=r"--reasoning-parser qwen3: the model's tokenizer has no token '<think>'"):
        get_reasoning_parser_cls("qwen3")(NoThink())


def test_unknown_parser_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown parser 'r2' \(available: deepseek_r1, qwen3\)"):
        get_reasoning_parser_cls("r2")
