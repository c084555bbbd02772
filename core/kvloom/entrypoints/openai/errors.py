"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is raised anywhere in request handling; the server turns it into the
response. ``from_validation_error`` turns pydantic errors into one 400 that names every
bad field, and the allowed range where the field has one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import annotated_types
from pydantic import BaseModel, ValidationError

from kvloom.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client caused (4xx) or that the server reports (5xx)."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code
        self.type = type or _default_type(self.status)

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {message, type, param, code}}``."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def internal_error(request_id: str) -> APIError:
    """The 500 a client gets for anything that is not its fault: no internal detail (that
    goes to the log), only the request id to look it up by."""
    return APIError(f"Internal server error (request id: {request_id}); the details are in the server log",
                    status=HTTPStatus.INTERNAL_SERVER_ERROR, code="internal_error")  # fmt: skip


def engine_dead_error(request_id: str) -> APIError:
    """The 500 for every open request when the engine core died: not the request's fault
    and not a secret (the server exits for its supervisor to restart it); the cause is in
    the server log."""
    return APIError(f"The engine core died while serving request {request_id}; the server is shutting down "
                    "(the cause is in the server log)", status=HTTPStatus.INTERNAL_SERVER_ERROR,
                    code="engine_error")  # fmt: skip


def renamed_fields(error: APIError, names: dict[str, str]) -> APIError:
    """``error`` with the field it names renamed by ``names`` (``{"max_completion_tokens":
    "max_tokens"}``): the errors of an API served through another in the outer API's words."""
    for inner, outer in names.items():
        if error.param == inner or error.message.startswith(inner + ":"):
            return APIError(outer + error.message.removeprefix(inner), status=error.status, param=outer,
                            code=error.code, type=error.type)  # fmt: skip
    return error


def _default_type(status: int) -> str:
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status == HTTPStatus.NOT_FOUND:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def format_loc(loc: Sequence[str | int]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


def allowed_range(model: type[BaseModel] | None, loc: Sequence[str | int]) -> str | None:
    """'0 <= temperature <= 100' from the field's ge/gt/le/lt constraints, if it has any."""
    field_model: Any = model
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(field_model, type) and issubclass(field_model, BaseModel)):
            return None
        info = field_model.model_fields.get(str(part))
        if info is None:
            return None
        field_model = info.annotation
    if info is None:
        return None
    low = high = ""
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = f"{m.ge} <= "
        elif isinstance(m, annotated_types.Gt):
            low = f"{m.gt} < "
        elif isinstance(m, annotated_types.Le):
            high = f" <= {m.le}"
        elif isinstance(m, annotated_types.Lt):
            high = f" < {m.lt}"
    if not low and not high:
        return None
    return f"{low}{loc[-1]}{high}"


def _strip_value_error(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def from_validation_errors(errors: Sequence[dict[str, Any]], model: type[BaseModel] | None = None) -> APIError:
    """One 400 listing every validation error as 'field: problem (allowed range: ...)'."""
    problems: list[str] = []
    params: list[str] = []
    for error in errors:
        loc = [p for p in error.get("loc", ()) if p != "body"]
        msg = _strip_value_error(str(error.get("msg", "invalid value")))
        if error.get("type") == "json_invalid":
            return APIError(f"Malformed JSON body: {error.get('ctx', {}).get('error', msg)}", param=None,
                            code="invalid_json")  # fmt: skip
        if loc:
            name = format_loc(loc)
            text = f"{name}: {msg}"
            bounds = allowed_range(model, loc)
            if bounds:
                text += f" (allowed range: {bounds})"
            if error.get("type") == "missing":
                text = f"{name}: field required"
        else:
            # Model-level checks phrase their message as 'field: problem'.
            text = msg
            name = msg.split(":", 1)[0] if ":" in msg else ""
            if model is not None and name not in model.model_fields:
                name = ""
        if name and name not in params:
            params.append(name)
        if text not in problems:
            problems.append(text)
    return APIError("; ".join(problems), param=params[0] if params else None, code="invalid_value")


def from_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> APIError:
    return from_validation_errors(exc.errors(include_url=False), model)


#: How deeply a request body's arrays and objects may nest (``--max-json-depth``).
DEFAULT_MAX_JSON_DEPTH = 64
#: The longest number literal a request body may hold, in characters
#: (``--max-json-number-length``): an int64 has 19 digits, a float's shortest exact form 24
#: characters; Python would spend quadratic time on a 10,000-digit integer.
DEFAULT_MAX_JSON_NUMBER_LENGTH = 100


class _NumberTooLong(Exception):
    pass


class _NotJSON(Exception):
    pass


def parse_json_body(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                    max_number_length: int = DEFAULT_MAX_JSON_NUMBER_LENGTH) -> Any:  # fmt: skip
    """The request body as JSON, or a 400 saying why it is not: malformed, not UTF-8, nested
    deeper than ``max_depth``, a number literal longer than ``max_number_length``
    characters, NaN/Infinity (not JSON), or a string that is not valid Unicode (a lone
    UTF-16 surrogate such as ``"\\ud800"``, which no tokenizer or response can encode;
    the message names the field)."""
    if not raw.strip():
        raise APIError("Request body is empty; expected a JSON object", code="invalid_json")

    def number(text: str) -> Any:
        if len(text) > max_number_length:
            raise _NumberTooLong(text)
        return int(text) if text.lstrip("-").isdigit() else float(text)

    def constant(text: str) -> Any:
        raise _NotJSON(text)

    # The number hooks cost a Python call per number: bodies without a digit run longer
    # than the limit (the common case; a run inside a string also counts) parse without them.
    hooks: dict[str, Any] = {"parse_constant": constant}
    if _has_long_digit_run(raw, max_number_length):
        hooks.update(parse_int=number, parse_float=number)
    try:
        data = json.loads(raw, **hooks)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"Malformed JSON body: {exc}", code="invalid_json") from None
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise APIError(f"Malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(f"Malformed JSON body: arrays and objects nest more than {max_depth} levels deep",
                       code="invalid_json") from None  # fmt: skip
    except _NumberTooLong as exc:
        raise APIError(f"Malformed JSON body: a number has {len(exc.args[0])} characters, more than the "
                       f"{max_number_length} allowed ({exc.args[0][:24]}...)", code="invalid_json") from None  # fmt: skip
    except _NotJSON as exc:
        raise APIError(f"Malformed JSON body: {exc.args[0]} is not a JSON value", code="invalid_json") from None
    check_json_value(data, max_depth)
    return data


_DIGITS_AS_ONES = bytes(0x31 if 0x30 <= c <= 0x39 else 0x30 for c in range(256))


def _has_long_digit_run(raw: bytes, max_number_length: int) -> bool:
    """Whether ``raw`` has a digit run that every number literal longer than
    ``max_number_length`` contains: such a literal has at most 4 other characters (``-``,
    ``.``, ``e``, a sign) and at most 3 digit runs (integer, fraction, exponent)."""
    run = max(1, (max_number_length - 4) // 3)
    return b"1" * run in raw.translate(_DIGITS_AS_ONES)


_SCALARS = frozenset({int, float, bool, type(None)})


def check_json_value(data: Any, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
    """A 400 if ``data`` nests deeper than ``max_depth`` or holds a string (or object key)
    that is not valid Unicode; the message names where (``messages[0].content``)."""
    # Iterative, so that no input can exhaust the stack: (value, path, depth).
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                _check_unicode(value, path)
        elif isinstance(value, (list, dict)):
            if depth >= max_depth:
                raise APIError(f"Malformed JSON body: arrays and objects nest more than {max_depth} levels deep"
                               f" (at {format_loc(path) or 'the top level'})", code="invalid_json")  # fmt: skip
            if isinstance(value, dict):
                for key, item in value.items():
                    if not key.isascii():
                        _check_unicode(key, path, is_key=True)
                    if isinstance(item, (str, list, dict)):
                        stack.append((item, (*path, key), depth + 1))
            elif not _SCALARS.issuperset(map(type, value)):  # (a list of numbers is done at C speed)
                for index, item in enumerate(value):
                    if isinstance(item, (str, list, dict)):
                        stack.append((item, (*path, index), depth + 1))


def _check_unicode(text: str, path: tuple[str | int, ...], is_key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = format_loc(path) or "body"
        what = f"{name}: an object key" if is_key else name + ":"
        char = text[exc.start]
        raise APIError(f"{what} is not valid Unicode: it contains the lone UTF-16 surrogate "
                       f"\\u{ord(char):04x} at position {exc.start}", param=format_loc(path) or None,
                       code="invalid_value") from None  # fmt: skip


#: How many ignored field names one warning lists, and how much of each name it shows
#: (a hostile body may hold thousands of long keys).
IGNORED_FIELDS_SHOWN = 10
IGNORED_FIELD_NAME_CHARS = 64


def validate_body(model: type[BaseModel], data: Any) -> Any:
    """``data`` (a JSON object) validated as ``model``; a 400 naming each bad field. Unknown
    fields are accepted (as in vLLM) and named in a warning."""
    if not isinstance(data, dict):
        raise APIError(f"Request body must be a JSON object, got {type(data).__name__}", code="invalid_value")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None
    ignored = request.ignored_fields() if hasattr(request, "ignored_fields") else []
    if ignored:
        shown = [name[:IGNORED_FIELD_NAME_CHARS] for name in ignored[:IGNORED_FIELDS_SHOWN]]
        more = f" (and {len(ignored) - len(shown)} more)" if len(ignored) > len(shown) else ""
        logger.warning("The following fields were present in the request but ignored: %s%s", shown, more)
    return request
