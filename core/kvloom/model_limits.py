"""What the served model allows a request: its limits and the rules that check a request
against them, each written once.

``ModelLimits`` are the bounds the model sets (its vocabulary, its context length,
``--max-logprobs``, its hidden size); ``check_against_model`` lists what a request
breaks as ``(field, message)`` pairs, the message naming the field, its value and the
allowed range. Three paths call it, and each says the same thing in its own way:
- the OpenAI server (``entrypoints/openai/serving_engine.py``): an HTTP 400 whose body
  names the field (``param``), in the request's own field names (``names``);
- the front end (``engine/input_processor.py``, under ``LLM``, ``LLMEngine`` and
  ``AsyncLLM``): a ``ValueError``;
- the engine core (``EngineCore.check_request``): the request is refused alone. The core
  trusts no client: with ``--api-server-count N`` several front ends feed it.

The ranges a field has whatever the model are ``SamplingParams``' own validators, not
rules here. A sampling field that the model bounds gets one rule in ``SAMPLING_RULES``
(``@sampling_rule("field")``), and all three paths check it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloom.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from kvloom.config import ModelConfig

#: A problem with a request: (the field, as the caller names it; the message, starting
#: with that name).
Problem = tuple[str, str]

#: A rule for one field: why ``value`` (never None) is not allowed under the limits, or
#: None. It gets the field's name (as the caller names it) to say the allowed range.
FieldRule = Callable[[str, Any, "ModelLimits"], str | None]


@dataclass(frozen=True)
class ModelLimits:
    """The bounds the served model sets on a request."""

    vocab_size: int
    """Token ids are ``0 .. vocab_size - 1``."""
    max_model_len: int
    """The longest sequence, prompt and output together."""
    max_logprobs: int
    """The most logprobs per token a request may ask for (``--max-logprobs``)."""
    hidden_size: int
    """The width of a pooled vector (pooling ``dimensions`` may only shorten it)."""

    @classmethod
    def of(cls, model: ModelConfig) -> ModelLimits:
        return cls(model.vocab_size, model.max_model_len, model.max_logprobs, model.hidden_size)


#: field -> rule, for the fields of ``SamplingParams`` / ``PoolingParams`` that the model
#: bounds, in the order their problems are reported.
SAMPLING_RULES: dict[str, FieldRule] = {}
POOLING_RULES: dict[str, FieldRule] = {}


def sampling_rule(*fields: str) -> Callable[[FieldRule], FieldRule]:
    """Register a rule for these ``SamplingParams`` fields."""
    return _registrar(SAMPLING_RULES, fields)


def pooling_rule(*fields: str) -> Callable[[FieldRule], FieldRule]:
    """Register a rule for these ``PoolingParams`` fields."""
    return _registrar(POOLING_RULES, fields)


def _registrar(rules: dict[str, FieldRule], fields: tuple[str, ...]) -> Callable[[FieldRule], FieldRule]:
    def register(rule: FieldRule) -> FieldRule:
        for field in fields:
            rules[field] = rule
        return rule

    return register


def out_of_vocab(ids: Sequence[int], vocab_size: int) -> str | None:
    """The problem with the first of ``ids`` outside the vocabulary ("token id X is out of
    range (allowed: 0..V-1)"), or None. Every path hands in ints (the server's schema, the
    front end's prompt check and the engine core's typed decoding see to it), so ``min``
    and ``max`` decide at C speed."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    return f"token id {bad} is out of range (allowed: 0..{vocab_size - 1})"


@sampling_rule("logprobs", "prompt_logprobs")
def _logprobs(name: str, value: int, limits: ModelLimits) -> str | None:
    if value <= limits.max_logprobs and value <= limits.vocab_size:
        return None
    if limits.max_logprobs <= limits.vocab_size:
        return (f"{value} is more than this engine allows (allowed range: 0 <= {name} <= {limits.max_logprobs}, "
                "max_logprobs, --max-logprobs)")  # fmt: skip
    return f"{value} is larger than the vocabulary (allowed range: 0 <= {name} <= {limits.vocab_size})"


@sampling_rule("top_k")
def _top_k(name: str, value: int, limits: ModelLimits) -> str | None:
    vocab = limits.vocab_size
    if value <= vocab:
        return None
    return (
        f"{value} is out of range (allowed: -1 or 0 to disable top-k, else 1 <= {name} <= {vocab}, the vocabulary size)"
    )


@sampling_rule("stop_token_ids")
def _token_ids(name: str, value: list[int], limits: ModelLimits) -> str | None:
    return out_of_vocab(value, limits.vocab_size)


@sampling_rule("logit_bias")
def _biased_token_ids(name: str, value: dict[int, float], limits: ModelLimits) -> str | None:
    return out_of_vocab(list(value), limits.vocab_size)


@pooling_rule("dimensions")
def _dimensions(name: str, value: int, limits: ModelLimits) -> str | None:
    width = limits.hidden_size
    if value <= width:
        return None
    return f"{value} is larger than the model's {width} (allowed range: 1 <= {name} <= {width})"


def prompt_problems(token_ids: Sequence[int], limits: ModelLimits, pooling: bool,
                    names: Mapping[str, str] | None = None) -> list[Problem]:  # fmt: skip
    """What is wrong with a prompt of these token ids: "prompt" when it is empty or too
    long (a generation needs room for one output token, a pooling does not), then
    "prompt_token_ids" for an id outside the vocabulary."""
    names = names or {}
    prompt = names.get("prompt", "prompt")
    n, max_len = len(token_ids), limits.max_model_len
    if n == 0:
        return [(prompt, f"{prompt}: the prompt is empty (it has no tokens)")]
    problems = []
    longest = max_len if pooling else max_len - 1
    if n > longest:  # first: the server tells it apart by its length alone (context_length_exceeded)
        room = "" if pooling else ", leaving room for one output token"
        message = (f"{prompt}: the prompt is {n} tokens, but this model's maximum context length is {max_len} tokens "
                   f"(allowed: at most {longest} prompt tokens{room})")  # fmt: skip
        problems.append((prompt, message))
    bad_id = out_of_vocab(token_ids, limits.vocab_size)
    if bad_id is not None:
        field = names.get("prompt_token_ids", "prompt_token_ids")
        problems.append((field, f"{field}: {bad_id}"))
    return problems


def params_problems(params: SamplingParams | PoolingParams, limits: ModelLimits,
                    names: Mapping[str, str] | None = None) -> list[Problem]:  # fmt: skip
    """What is wrong with these sampling or pooling parameters for this model."""
    names = names or {}
    rules = POOLING_RULES if isinstance(params, PoolingParams) else SAMPLING_RULES
    problems = []
    for field, rule in rules.items():
        value = getattr(params, field)
        if value is None:
            continue
        name = names.get(field, field)
        message = rule(name, value, limits)
        if message is not None:
            problems.append((name, f"{name}: {message}"))
    return problems


def check_against_model(params: SamplingParams | PoolingParams, prompt_token_ids: Sequence[int],
                        limits: ModelLimits, names: Mapping[str, str] | None = None) -> list[Problem]:  # fmt: skip
    """Every rule of this module that the request breaks (``[]``: none), as ``(field,
    message)`` pairs; ``names`` renames fields to the caller's (e.g. the chat API's
    ``top_logprobs`` for ``logprobs``)."""
    pooling = isinstance(params, PoolingParams)
    return prompt_problems(prompt_token_ids, limits, pooling, names) + params_problems(params, limits, names)
