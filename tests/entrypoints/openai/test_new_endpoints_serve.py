"""Issue 36's acceptance against a real `kvloom serve` (the tiny random Llama, its tokenizer
given ``<think>`` and ``</think>``, ``--reasoning-parser deepseek_r1``, auto tool choice with
the hermes parser, the example ``forced_tokens`` logits processor installed):

* the openai client's ``responses.create`` (plain, streaming, tools) and the anthropic
  client's ``messages.create`` (plain, streaming, tools);
* reasoning end to end: the model is made to think (``vllm_xargs.forced_tokens`` forces its
  first tokens, ``</think>`` last); chat returns the forced text as ``reasoning`` and
  ``reasoning_content`` and the rest as ``content``, streamed or not, and a JSON schema
  binds only the answer after the reasoning (the grammar in the engine core);
* ``/ping``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from kvloom.testing.install import KvloomServer, install_distribution
from kvloom.testing.models import tiny_model_dir
from tests.helpers.plugin_server import REPO

MODEL = "tiny-r1"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-r1")
    shutil.copytree(tiny_model_dir("llama"), out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(["<think>", "</think>"])  # ids 320, 321 of the model's 512
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    work = tmp_path_factory.mktemp("serve")
    site = install_distribution(REPO / "plugins" / "examples" / "logits_processor", work / "site")
    args = [str(model_dir), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", MODEL, "--api-key", "k", "--reasoning-parser", "deepseek_r1",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-stats"]  # fmt: skip
    with KvloomServer(args, work, site_dirs=[site]) as srv:
        yield srv


@pytest.fixture(scope="module")
def thought(model_dir: Path) -> tuple[list[int], str]:
    """Token ids that make the model think "I think" and end its reasoning."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode("I think", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("</think>")]
    return ids, tokenizer.decode(ids[:-1])


@pytest.fixture(scope="module")
def answered(model_dir: Path, thought: tuple[list[int], str]) -> tuple[list[int], str, str]:
    """Token ids of a whole reply: the thought, the answer "Hi there", the end of sequence."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = thought[0] + tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    return ids, thought[1], "Hi there"


@pytest.fixture(scope="module")
def oai(server: KvloomServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: KvloomServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120)


def test_responses(oai: openai.OpenAI, thought: tuple[list[int], str], answered: tuple[list[int], str, str]) -> None:
    ids, reasoning_text, answer = answered
    xargs = {"vllm_xargs": {"forced_tokens": ids}}
    plain = oai.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=20,
                                 extra_body=xargs)  # fmt: skip
    reasoning, message = plain.output
    assert reasoning.content[0].text == reasoning_text and plain.output_text == answer
    assert plain.status == "completed" and plain.usage.output_tokens == len(ids)
    with oai.responses.stream(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=20,
                              extra_body=xargs) as stream:  # fmt: skip
        streamed = stream.get_final_response()
    assert streamed.output_text == answer and streamed.output[0].content[0].text == reasoning_text
    cut = oai.responses.create(model=MODEL, input="Hello", max_output_tokens=3, extra_body=xargs)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    called = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
                                  max_output_tokens=150, extra_body={"vllm_xargs": {"forced_tokens": thought[0]}})
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather", called.output
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = oai.responses.create(model=MODEL, previous_response_id=called.id, max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])  # fmt: skip
    assert follow.previous_response_id == called.id and follow.usage.input_tokens > called.usage.input_tokens


def test_messages(claude: anthropic.Anthropic, thought: tuple[list[int], str],
                  answered: tuple[list[int], str, str]) -> None:  # fmt: skip
    ids, reasoning_text, answer = answered
    xargs = {"vllm_xargs": {"forced_tokens": ids}}
    plain = claude.messages.create(model=MODEL, max_tokens=20, system="Be brief.", extra_body=xargs,
                                   messages=[{"role": "user", "content": "Hello"}])  # fmt: skip
    assert [b.type for b in plain.content] == ["thinking", "text"]
    assert (plain.content[0].thinking, plain.content[1].text, plain.stop_reason) == (reasoning_text, answer, "end_turn")
    with claude.messages.stream(model=MODEL, max_tokens=20, system="Be brief.", extra_body=xargs,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    called = claude.messages.create(model=MODEL, max_tokens=150, tools=tools, tool_choice={"type": "any"},
                                    extra_body={"vllm_xargs": {"forced_tokens": thought[0]}},
                                    messages=[{"role": "user", "content": "Weather?"}])  # fmt: skip
    call = called.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    assert called.stop_reason == "tool_use"
    assert claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello"}]).input_tokens > 0


def test_reasoning_in_chat_whole_and_streamed(oai: openai.OpenAI, answered: tuple[list[int], str, str]) -> None:
    ids, reasoning_text, answer = answered
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                extra_body={"vllm_xargs": {"forced_tokens": ids}})  # fmt: skip
    message = oai.chat.completions.create(**body).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (reasoning_text, reasoning_text, answer)
    chunks = list(oai.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning_text
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning_text
    assert "".join(d.content or "" for d in deltas) == answer


def test_the_grammar_binds_the_answer_after_the_reasoning(oai: openai.OpenAI, thought: tuple[list[int], str]) -> None:
    ids, text = thought
    message = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A number?"}], max_tokens=40, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={"vllm_xargs": {"forced_tokens": ids}},
    ).choices[0].message  # fmt: skip
    assert message.reasoning == text  # the forced reasoning was free (no JSON allows "I think")
    assert 0 <= json.loads(message.content)["n"] <= 9


def test_ping(server: KvloomServer) -> None:
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
