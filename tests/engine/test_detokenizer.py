"""Incremental detokenizer tests against real tokenizers' full decodes."""

from __future__ import annotations

import random

import pytest
from tests.helpers.tokenizer_fixtures import ALL_TOKENIZERS, HARD_TEXTS, byte_level_tokenizer, smollm2_tokenizer

from kvloom.engine.detokenizer import IncrementalDetokenizer
from kvloom.sampling_params import SamplingParams

PROMPT = "Write something:"


def reference_text(tok, prompt_ids, out_ids, skip_special_tokens=True):
    """What the output text must be: the full decode of prompt+output minus the prompt's
    (a single decode of the output alone would lose a sentencepiece leading space)."""
    kw = dict(skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    full = tok.decode(prompt_ids + out_ids, **kw)
    prompt = tok.decode(prompt_ids, **kw)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def run_stream(detok, out_ids, chunks, finish_with_stop_token=False):
    """Feed out_ids in the given chunk sizes; return (deltas, stop_string)."""
    deltas, i, stop = [], 0, None
    for n in chunks:
        piece = out_ids[i : i + n]
        i += n
        last = i >= len(out_ids)
        stop = detok.update(piece, stop_terminated=finish_with_stop_token and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return deltas, stop


def random_chunks(n, rng):
    chunks = []
    while n > 0:
        c = min(n, rng.choice([1, 1, 1, 2, 3, 5]))
        chunks.append(c)
        n -= c
    return chunks


@pytest.mark.parametrize("tok_name", list(ALL_TOKENIZERS))
@pytest.mark.parametrize("text", HARD_TEXTS)
def test_streamed_text_equals_full_decode(tok_name, text):
    tok = ALL_TOKENIZERS[tok_name]()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    out_ids = tok.encode(" " + text, add_special_tokens=False)
    expected = reference_text(tok, prompt_ids, out_ids)
    assert "\ufffd" not in expected
    rng = random.Random(hash((tok_name, text)) & 0xFFFF)
    for chunks in ([1] * len(out_ids), random_chunks(len(out_ids), rng)):
        detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
        deltas, stop = run_stream(detok, out_ids, chunks)
        assert stop is None
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == expected == detok.output_text
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        assert detok.token_ids == out_ids


def test_test_texts_really_split_characters_across_tokens():
    # Guard for the test above: with each real tokenizer some single token decodes to an
    # incomplete character, so the incremental path is exercised.
    for name in ALL_TOKENIZERS:
        tok = ALL_TOKENIZERS[name]()
        ids = tok.encode(" ".join(HARD_TEXTS), add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids), name


def test_smollm2_emoji_and_cjk_split_across_tokens():
    tok = smollm2_tokenizer()
    text = " 日本語のテキスト 🌍🎉👩‍👩‍👧"
    prompt_ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    out_ids = tok.encode(text, add_special_tokens=False)
    assert len(out_ids) > len(text.split())  # characters spread over several tokens
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas, _ = run_stream(detok, out_ids, [1] * len(out_ids))
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to wait for the rest of a character


def test_sentencepiece_first_output_token_keeps_its_leading_space():
    tok = ALL_TOKENIZERS["sentencepiece_style"]()
    prompt_ids = tok.encode("Hello world,", add_special_tokens=False)
    # sentencepiece encodes "the fox" as "▁the▁fox": the tokens a model continues with
    out_ids = tok.encode("the fox", add_special_tokens=False)
    # decoding the output alone drops the leading space (sentencepiece behaviour)
    assert not tok.decode(out_ids).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    detok.update(out_ids, stop_terminated=False)
    assert detok.output_text == reference_text(tok, prompt_ids, out_ids)
    assert detok.output_text.startswith(" ")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip):
    tok = smollm2_tokenizer()
    prompt_ids = tok.encode("Hi", add_special_tokens=False)
    out_ids = tok.encode(" one", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    out_ids += tok.encode(" two", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=skip))
    detok.update(out_ids, stop_terminated=False)
    assert detok.output_text == (" one two" if skip else " one<|im_end|> two")
    assert detok.token_ids == out_ids


def test_stop_token_is_kept_in_ids_but_not_in_text():
    tok = smollm2_tokenizer()
    prompt_ids = tok.encode("Hi", add_special_tokens=False)
    body = tok.encode(" one two", add_special_tokens=False)
    stop_tok = tok.encode(" three", add_special_tokens=False)[0]  # a non-special stop token id
    for include, expected in ((False, " one two"), (True, " one two three")):
        detok = IncrementalDetokenizer(
            tok, prompt_ids, SamplingParams(stop_token_ids=[stop_tok], include_stop_str_in_output=include, skip_special_tokens=False)
        )
        detok.update(body, stop_terminated=False)
        detok.update([stop_tok], stop_terminated=True)
        assert detok.token_ids == body + [stop_tok]
        assert detok.output_text == expected
    # EOS with skip_special_tokens: kept in ids, never shown
    eos = tok.eos_token_id
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(include_stop_str_in_output=True))
    detok.update(body + [eos], stop_terminated=True)
    assert detok.token_ids == body + [eos] and detok.output_text == " one two"


def stop_case(stop, include=False, text=" alpha beta gamma delta beta omega"):
    tok = byte_level_tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    out_ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=stop, include_stop_str_in_output=include))
    deltas, found = run_stream(detok, out_ids, [1] * len(out_ids))
    return detok, deltas, found, out_ids, tok


def test_stop_string_truncates_and_reports():
    detok, deltas, found, out_ids, tok = stop_case(["beta"])
    assert found == "beta"
    assert detok.output_text == " alpha "
    assert "".join(deltas) == " alpha "
    # tokens after the one completing the stop string were never consumed
    assert len(detok.token_ids) < len(out_ids)
    assert "beta" in tok.decode(detok.token_ids)


def test_stop_string_included_when_asked():
    detok, deltas, found, _, _ = stop_case(["beta"], include=True)
    assert found == "beta"
    assert detok.output_text == " alpha beta" == "".join(deltas)


def test_earliest_stop_string_wins():
    detok, _, found, _, _ = stop_case(["delta", "gamma", "omega"])
    assert found == "gamma" and detok.output_text == " alpha beta "


def test_stop_string_inside_one_multi_token_step_drops_later_tokens():
    tok = byte_level_tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    out_ids = tok.encode(" one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["two"]))
    assert detok.update(out_ids, stop_terminated=False) == "two"
    assert detok.output_text == " one "
    assert tok.decode(detok.token_ids).endswith("two")


def test_delta_mode_never_emits_a_partial_stop_string():
    # "bet" appears (a prefix of the stop string "beta!") and must be held back until
    # it is clear it is not the stop string; then it is released.
    text = " bet bet beta! tail"
    detok, deltas, found, _, _ = stop_case(["beta!"], text=text)
    assert found == "beta!"
    emitted = ""
    for d in deltas:
        emitted += d
        # nothing shown is ever taken back: every prefix stays a prefix of the final text
        assert " bet bet ".startswith(emitted)
    assert emitted == " bet bet "
    # without a stop, everything is eventually emitted (hold-back released at finish)
    detok, deltas, found, _, _ = stop_case(["beta!"], text=" bet bet bet")
    assert found is None and "".join(deltas) == " bet bet bet"
    assert deltas[-1].endswith("bet")  # the held back tail came with the final output


def test_cumulative_mode_holds_back_too():
    tok = byte_level_tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["xyz12"]))
    detok.update(tok.encode(" hello", add_special_tokens=False), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == " h"
    assert detok.get_next_output_text(finished=True, delta=False) == " hello"


def test_without_tokenizer_only_token_ids():
    detok = IncrementalDetokenizer(None, [1, 2, 3], SamplingParams())
    assert detok.update([5, 6], stop_terminated=False) is None
    assert detok.update([7], stop_terminated=True) is None
    assert detok.token_ids == [5, 6, 7]
    assert detok.get_next_output_text(finished=True, delta=False) == ""
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(None, [1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="detokenize=False"):
        IncrementalDetokenizer(byte_level_tokenizer(), [1], SamplingParams(stop=["x"], detokenize=False))
    # detokenize=False: ids only even with a tokenizer
    detok = IncrementalDetokenizer(byte_level_tokenizer(), [1], SamplingParams(detokenize=False))
    detok.update([40, 41], stop_terminated=False)
    assert detok.output_text == "" and detok.token_ids == [40, 41]


@pytest.mark.parametrize("tok_name", ALL_TOKENIZERS)
def test_window_decoder_decodes_as_the_tokenizer_does(tok_name):
    """The fast path (the backend tokenizer, for stock fast tokenizers) gives exactly the
    wrapper's decode, special tokens kept or skipped, on random windows of real text."""
    from kvloom.engine.detokenizer import decode_ids, window_decoder

    tok = ALL_TOKENIZERS[tok_name]()
    decode = window_decoder(tok)
    ids = tok.encode(" ".join(HARD_TEXTS), add_special_tokens=True)
    ids += [t for t in tok.all_special_ids if t is not None][:3]
    rng = random.Random(0)
    for _ in range(200):
        start = rng.randrange(len(ids))
        window = ids[start : start + rng.randint(1, 8)]
        for skip in (True, False):
            assert decode(window, skip) == decode_ids(tok, window, skip)


def test_a_tokenizer_that_overrides_decode_keeps_its_own():
    from transformers import PreTrainedTokenizerFast

    from kvloom.engine.detokenizer import window_decoder

    import copy

    tok = copy.copy(byte_level_tokenizer())  # the fixture's is shared: change a copy's class

    class Shouting(type(tok)):  # a plugin's tokenizer with its own decoding
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    tok.__class__ = Shouting
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok.encode("hello there", add_special_tokens=False)
    assert window_decoder(tok)(ids, True) == "HELLO THERE"
