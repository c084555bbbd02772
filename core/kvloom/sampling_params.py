"""User-facing generation and pooling parameters, with vLLM's names and validation."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Upper bound for ``seed`` so it fits a torch generator seed.
_MAX_SEED = 2**63 - 1

#: Most stop strings a request may have, and the longest (in characters): the front end
#: searches each one in the new text of every step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024
#: Most stop token ids and logit_bias entries a request may have.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
#: The allowed range of a logit_bias value (OpenAI's).
MAX_LOGIT_BIAS = 100.0
#: Largest token id, count or priority that fits the engine's int32/int64 tensors. Token
#: ids are also checked against the model's vocabulary when the request is added.
MAX_INT32 = 2**31 - 1
#: The largest ``kv_transfer_params`` (as JSON, in characters) a request may carry.
MAX_KV_TRANSFER_PARAMS_CHARS = 16384
#: ``kv_transfer_params`` keys that every connector reads as vLLM does: booleans.
KV_TRANSFER_FLAGS = ("do_remote_decode", "do_remote_prefill")


def check_kv_transfer_params(value: Any) -> dict[str, Any] | None:
    """``kv_transfer_params`` as a request may carry them: a JSON object of at most
    ``MAX_KV_TRANSFER_PARAMS_CHARS`` characters, its ``do_remote_*`` flags booleans (the
    connector checks the rest when the request is added)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("kv_transfer_params must be a JSON object")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv_transfer_params must be plain JSON ({exc})") from None
    if len(text) > MAX_KV_TRANSFER_PARAMS_CHARS:
        raise ValueError(f"kv_transfer_params has {len(text)} characters as JSON (allowed: at most "
                         f"{MAX_KV_TRANSFER_PARAMS_CHARS})")  # fmt: skip
    for flag in KV_TRANSFER_FLAGS:
        if flag in value and not isinstance(value[flag], bool):
            raise ValueError(f"kv_transfer_params.{flag} must be true or false")
    return value


def check_unicode(value: str, name: str) -> str:
    """``value``, or a ``ValueError`` if it is not valid Unicode (a lone UTF-16 surrogate,
    which no tokenizer or response can encode)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} is not valid Unicode (lone UTF-16 surrogate \\u{ord(value[exc.start]):04x} "
                             f"at position {exc.start})") from None  # fmt: skip
    return value


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrain the output to a format (vLLM's ``StructuredOutputsParams``): exactly one
    of ``json`` (a JSON schema, as a dict or a JSON string), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of these strings), ``grammar`` (an EBNF/GBNF
    grammar whose start rule is ``root``) or ``structural_tag`` (xgrammar's structural tag,
    a dict or JSON string).

    A dataclass (as in vLLM, whose ``json`` field a pydantic model could not have). Only
    the shape is checked here; whether the schema, regex or grammar compiles is checked
    by the structured-output backend when the request is processed
    (``kvloom.structured_output.validate_structured_outputs``), so a bad one is an error
    naming the problem.
    """

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text)."""
    json_object: bool | None = None
    """``True``: any JSON object."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is one of these strings."""
    grammar: str | None = None
    """An EBNF/GBNF grammar whose start rule is ``root``."""
    structural_tag: dict[str, Any] | str | None = None
    """An xgrammar structural tag (a dict, or its JSON text)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between items (shorter output, fewer tokens)."""

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs: exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must be set "
                f"(got {', '.join(kinds) if kinds else 'none'})"
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        if kind in ("json", "structural_tag") and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.{kind} must be an object or a JSON string, got {type(value).__name__}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            for c in value:
                check_unicode(c, "a choice")

    @property
    def kind(self) -> str:
        """The one kind that is set (``json``, ``json_object``, ``regex``, ...)."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The kind's value as one string: the key of the compiled-grammar cache, and what
        a backend compiles (JSON for dicts and choice lists)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            return ""
        if isinstance(value, (dict, list)):
            return json.dumps(value, sort_keys=True)
        return value


#: The kinds of ``StructuredOutputsParams``, in the order error messages list them.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class RequestOutputKind(enum.Enum):
    """How outputs are delivered while a request runs."""

    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(BaseModel):
    """Sampling parameters for text generation (vLLM's ``SamplingParams``).

    Invalid values raise ``pydantic.ValidationError`` (a ``ValueError``) naming the field
    and its allowed range.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)

    n: int = Field(1, ge=1, le=128, description="Number of output sequences per prompt.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Penalise tokens that appeared in the output so far (OpenAI semantics)."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Penalise tokens by how often they appeared in the output so far."""
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """Penalise prompt and output tokens: positive logits are divided by it, negative ones
    multiplied (1 = off)."""
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Sample from the smallest token set whose probability reaches ``top_p`` (1 = off)."""
    top_k: int = Field(0, ge=-1, le=MAX_INT32, description="0 or -1 disables top-k; at most the vocabulary size.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Drop tokens whose probability is below ``min_p`` times the most likely one (0 = off)."""
    seed: int | None = Field(None, ge=-_MAX_SEED, le=_MAX_SEED)
    """Per-request seed for reproducible sampling (``None`` = the engine's generator)."""
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    """Strings that end the output (not included unless ``include_stop_str_in_output``)."""
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    """Token ids that end the output (included in it)."""
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    """Token id -> value added to its logit before sampling (OpenAI's logit_bias)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32, description="None = up to max_model_len.")
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    """Tokens to generate before EOS or stop token ids may end the output."""
    logprobs: int | None = Field(None, ge=0, le=20, description="Top-N logprobs per output token.")
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """Top-N logprobs per prompt token."""
    detokenize: bool = True
    """Produce output text (else only token ids)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the output text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Outputs carry everything so far (``CUMULATIVE``), only the new part (``DELTA``), or
    come once, at the end (``FINAL_ONLY``)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice, a grammar, ... (see
    ``StructuredOutputsParams``)."""
    extra_args: dict[str, Any] | None = None
    """Arguments of logits processor plugins, ``{processor name: its value}`` (vLLM's
    ``extra_args``; the server's ``vllm_xargs``); each processor checks its own value when
    the request is added."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the engine's KV connector reads for this request (vLLM's field), e.g.
    ``{"do_remote_decode": true}`` for a prefill whose decode runs elsewhere, or the params
    a prefill's output carried for its decode. Refused by an engine without a connector."""

    @field_validator("kv_transfer_params")
    @classmethod
    def _check_kv_transfer_params(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_kv_transfer_params(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        for s in v:
            if len(s) > MAX_STOP_STRING_LENGTH:
                raise ValueError(f"a stop string has {len(s)} characters (allowed: at most {MAX_STOP_STRING_LENGTH})")
            check_unicode(s, "a stop string")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_as_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, v: list[int]) -> list[int]:
        if any(not 0 <= t <= MAX_INT32 for t in v):
            raise ValueError(f"stop_token_ids must be token ids (allowed range: 0 <= id <= {MAX_INT32}, and "
                             "below the vocabulary size)")  # fmt: skip
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for token_id, bias in (v or {}).items():
            if not 0 <= token_id <= MAX_INT32:
                raise ValueError(f"key {token_id} is not a token id (allowed range: 0 <= id < the vocabulary size)")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {token_id} is {bias} (allowed range: "
                                 f"{-MAX_LOGIT_BIAS} <= bias <= {MAX_LOGIT_BIAS})")  # fmt: skip
        return v or None

    @model_validator(mode="after")
    def _check_combinations(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to "
                f"max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        """Whether sampling is greedy (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's earlier tokens (presence, frequency or
        repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class PoolingParams(BaseModel):
    """Parameters for pooling (embedding) requests.

    ``pooling_type`` overrides the model's default ("LAST" or "MEAN"); ``normalize``
    L2-normalises the pooled vector; ``dimensions`` truncates it (Matryoshka-style).
    """

    model_config = ConfigDict(extra="forbid")

    pooling_type: str | None = Field(None, pattern="^(LAST|MEAN|CLS)$")
    """``"LAST"``, ``"MEAN"`` or ``"CLS"``; ``None`` = the model's pooling type."""
    normalize: bool | None = None
    """L2-normalise the pooled vector; ``None`` = the model's setting."""
    dimensions: int | None = Field(None, ge=1)
    """Keep the first ``dimensions`` values (then normalise); ``None`` = all."""
