"""One message for a pydantic ``ValidationError`` of a flag-backed model, worded as the server
words its 400s. Kept apart from ``engine_args`` so ``EngineArgs`` can describe its own errors
without importing the CLI module that imports it."""

from __future__ import annotations

import typing

from pydantic import BaseModel, ValidationError


def describe_validation_error(
    exc: ValidationError, model: type[BaseModel], flag_for: typing.Callable[[str], str]
) -> str:
    """One message naming each bad flag (``flag_for(field name)``), the problem and the
    allowed range where the field has one, as the server words its 400s
    (``--top-p: Input should be less than or equal to 1 (allowed range: 0.0 < top_p <= 1.0)``)."""
    from kvloom.entrypoints.openai.errors import allowed_range

    problems = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        msg = str(error["msg"]).removeprefix("Value error, ")
        if not loc:  # model-level checks name their fields themselves
            problems.append(msg)
            continue
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown option {flag_for(loc[0])}{_did_you_mean(loc[0], model, flag_for)}")
            continue
        text = f"{flag_for(loc[0])}: {msg}"
        bounds = allowed_range(model, loc[:1])
        if bounds:
            text += f" (allowed range: {bounds})"
        problems.append(text)
    return "; ".join(problems)


def _did_you_mean(name: str, model: type[BaseModel], flag_for: typing.Callable[[str], str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(model.model_fields), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(flag_for(c) for c in close)}?)" if close else ""
