"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is raised anywhere in request handling; the server turns it into the
response. ``from_validation_error`` turns pydantic errors into one 400 that names every
bad field, and the allowed range where the field has one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import annotated_types
from pydantic import BaseModel, ValidationError

from kvloom.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


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
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


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


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, or a 400 saying why it is not."""
    if not raw.strip():
        raise APIError("Request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"Malformed JSON body: {exc}", code="invalid_json") from None


def validate_body(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(f"Request body must be a JSON object, got {type(data).__name__}", code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None
