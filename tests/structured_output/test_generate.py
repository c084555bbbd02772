"""Structured outputs end to end on the default model (SmolLM2 GGUF, CPU): sampled at
temperature 1, every output follows its JSON schema, regex or choice; a request whose
grammar fails to compile in the engine fails alone."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvloom import LLM, SamplingParams, StructuredOutputsParams
from kvloom.testing.json_schema import schema_errors

pytestmark = pytest.mark.slow

#: Nested objects, an array, enums, required fields; strings and arrays bounded (and
#: strings to letters, one token or more each), so that 120 tokens always hold the whole
#: object (without free whitespace, which is unbounded). xgrammar does not apply
#: maxLength to a string that has a pattern (measured: an 12-letter city came out of
#: maxLength 8 with pattern ^[A-Za-z]+$), so the patterns carry the bounds too.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z]{1,8}$"},
        "species": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5, "pattern": "^[a-z]{1,5}$"}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z]{1,8}$"},
                           "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "species", "age", "tags", "owner"],
    "additionalProperties": False,
}  # fmt: skip


def test_schema_errors_catches_what_it_checks() -> None:
    good = {"name": "Tom", "species": "cat", "age": 3, "tags": ["a"], "owner": {"city": "Oslo", "verified": True}}
    assert schema_errors(good, SCHEMA) == []
    bad = {**good, "name": "T m", "species": "cow", "age": 31, "tags": ["a"] * 3, "owner": {"city": "x" * 9},
           "extra": 1}  # fmt: skip
    assert len(schema_errors(bad, SCHEMA)) == 8  # the long city breaks maxLength and pattern
    with pytest.raises(ValueError, match=r"schema at \$\.x: unsupported keywords \['minLength'\]"):
        schema_errors({"x": "a"}, {"type": "object", "properties": {"x": {"type": "string", "minLength": 2}}})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(disable_log_stats=True, kv_cache_memory="2GiB")  # 100 sequences at once, no preemption


@pytest.mark.timeout(2400)  # 100 sequences of up to ~80 tokens: minutes on a shared 2-core CPU
def test_json_schema_holds_in_100_of_100_samples(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Describe a pet as JSON with name, species, age, tags and owner."}]
    params = SamplingParams(n=100, temperature=1.0, max_tokens=120, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))  # fmt: skip
    (output,) = llm.chat(messages, params, use_tqdm=False)
    assert len(output.outputs) == 100
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert schema_errors(value, SCHEMA) == [], completion.text


@pytest.mark.timeout(2400)
def test_regex_and_choice_hold_in_100_of_100_samples(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]
    outputs = llm.generate(
        ["A name and a phone number:", "The sentiment of 'what a day' is"],
        [SamplingParams(n=100, temperature=1.0, max_tokens=40, seed=1,
                        structured_outputs=StructuredOutputsParams(regex=regex)),
         SamplingParams(n=100, temperature=1.0, max_tokens=10, seed=2,
                        structured_outputs=StructuredOutputsParams(choice=choices))],
        use_tqdm=False,
    )  # fmt: skip
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in outputs[0].outputs), [
        c.text for c in outputs[0].outputs if not re.fullmatch(regex, c.text)]
    assert all(c.text in choices and c.finish_reason == "stop" for c in outputs[1].outputs)
    assert len({c.text for c in outputs[1].outputs}) > 1  # sampled, not one forced answer


def test_other_kinds_and_bad_specs(llm: LLM) -> None:
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outputs = llm.generate(
        ["Some JSON:", "A sum:"],
        [SamplingParams(temperature=1.0, max_tokens=60, seed=3,
                        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
         SamplingParams(temperature=1.0, max_tokens=40, seed=4, structured_outputs=StructuredOutputsParams(grammar=grammar))],
        use_tqdm=False,
    )  # fmt: skip
    if outputs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outputs[0].outputs[0].text), dict)
    else:  # any JSON object is unbounded: what came must start one
        assert outputs[0].outputs[0].text.startswith("{")
    text = outputs[1].outputs[0].text
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) or outputs[1].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"structured_outputs\.json: invalid json: .*Unsupported type \"strng\""):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strng"})))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: invalid regex: .*parenthesis is not closed"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
    with pytest.raises(ValueError, match=r"exactly one of json, json_object, regex, choice, grammar, structural_tag"):
        StructuredOutputsParams(regex="a", choice=["b"])
