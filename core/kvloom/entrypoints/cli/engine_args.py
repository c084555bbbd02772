"""argparse flags generated from ``kvloom.config.EngineArgs``.

Every ``EngineArgs`` field becomes ``--field-name`` (underscores as dashes) with its
description as help text, so ``kvloom serve``, ``kvloom generate`` and the benchmarks
accept the same engine flags and a new field is a new flag without further work:

* ``bool`` fields: ``--x`` / ``--no-x``;
* ``Literal``/enum fields: ``choices``;
* ``list[int]`` fields: one or more values (``--x 1 2 4`` or ``--x 1,2,4``); ``list[str]``:
  one or more values;
* ``dict[str, str]`` fields: ``name=path`` pairs (``--lora-modules a=/p/a b=/p/b``);
  ``dict[str, Any]`` fields: a JSON object (``--structured-outputs-config '{"enable_in_reasoning": true}'``);
* ``optimization_level`` also answers to ``-O0`` .. ``-O3``, ``kv_cache_memory`` to vLLM's
  ``--kv-cache-memory-bytes``.

Flags the user does not give are absent from the namespace, so ``EngineArgs``' own
defaults apply and validation errors come from one place.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from typing import Any, Literal

from pydantic.fields import FieldInfo

from kvloom.engine.arg_utils import EngineArgs, EngineArgsError
from kvloom.entrypoints.cli.validation import describe_validation_error

#: Extra spellings of some flags (vLLM's): -O, -tp, -pp, and vLLM's name of the KV-cache size.
_SHORT_FLAGS: dict[str, list[str]] = {
    "optimization_level": ["-O"],
    "kv_cache_memory": ["--kv-cache-memory-bytes"],
    "tensor_parallel_size": ["-tp"],
    "pipeline_parallel_size": ["-pp"],
}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for ``X | None`` / ``Optional[X]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
        return typing.Union[tuple(args)], optional  # noqa: UP007 (runtime construction)
    return annotation, False


def _parse_key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, value


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}")
    return value


def _parse_int_list_item(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers (e.g. 1 2 4 or 1,2,4), got {text!r}") from None


class _FlattenIntLists(argparse.Action):
    """Collects ``--x 1 2 4`` and ``--x 1,2,4`` into one list of ints."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, [v for chunk in values for v in chunk])


class _KeyValuesToDict(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        result = dict(getattr(namespace, self.dest, None) or {})
        result.update(values)
        setattr(namespace, self.dest, result)


def _help(field: FieldInfo, extra: str = "") -> str:
    text = field.description or ""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, enum.Enum):
        default = default.value
    text = f"{text} {extra}".strip()
    # '%' would be read as a format directive by argparse.
    return f"{text} (default: {default})".replace("%", "%%")


def _add_field(group: argparse._ArgumentGroup, name: str, field: FieldInfo) -> None:
    inner, _optional = _unwrap_optional(field.annotation)
    flags = _SHORT_FLAGS.get(name, []) + [flag_name(name)]
    common: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    origin = typing.get_origin(inner)

    if inner is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, help=_help(field), **common)
    elif origin is Literal:
        choices = list(typing.get_args(inner))
        kind = type(choices[0])
        group.add_argument(*flags, type=kind, choices=choices, metavar="{" + ",".join(map(str, choices)) + "}",
                           help=_help(field), **common)  # fmt: skip
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        choices = [member.value for member in inner]
        group.add_argument(*flags, choices=choices, help=_help(field), **common)
    elif inner in (int, float, str):
        metavar = "N" if inner is int else None
        if name == "optimization_level":
            metavar = "{0,1,2,3}"
        group.add_argument(*flags, type=inner, metavar=metavar, help=_help(field), **common)
    elif origin is list and typing.get_args(inner) == (int,):
        group.add_argument(*flags, type=_parse_int_list_item, nargs="+", action=_FlattenIntLists,
                           metavar="N", help=_help(field), **common)  # fmt: skip
    elif origin is list and typing.get_args(inner) == (str,):
        group.add_argument(*flags, type=str, nargs="+", metavar="VALUE", help=_help(field), **common)
    elif origin is dict and typing.get_args(inner) == (str, str):
        group.add_argument(*flags, type=_parse_key_value, nargs="+", action=_KeyValuesToDict,
                           metavar="NAME=PATH", help=_help(field), **common)  # fmt: skip
    elif origin is dict and typing.get_args(inner) == (str, Any):
        # vLLM's *-config flags: a JSON object ('{"enable_in_reasoning": true}').
        group.add_argument(*flags, type=_parse_json_object, metavar="JSON", help=_help(field), **common)
    elif origin in (typing.Union, types.UnionType) and set(typing.get_args(inner)) <= {int, str}:
        # e.g. kv_cache_memory: int | str ("4GiB"); EngineArgs parses the string.
        group.add_argument(*flags, type=str, help=_help(field), **common)
    else:
        # Loud on purpose: a new EngineArgs field with a new kind of type needs a rule here.
        raise TypeError(f"EngineArgs.{name}: no CLI flag rule for type {field.annotation!r}")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """Add one flag per ``EngineArgs`` field (except those in ``skip``) to ``parser``, and
    the model as an optional positional argument, as ``vllm serve MODEL`` takes it."""
    if "model" not in skip:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                            help="The model (same as --model): a folder, a .gguf file or a Hugging Face Hub id.")
    group = parser.add_argument_group("engine arguments", "Options of kvloom.config.EngineArgs.")
    for name, field in EngineArgs.model_fields.items():
        if name not in skip:
            _add_field(group, name, field)
    return parser


def engine_args_from_namespace(namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """``EngineArgs`` from the flags present in ``namespace`` (plus ``overrides``); the
    positional MODEL stands for ``--model``.

    A ``ValidationError`` is re-raised as ``ValueError`` whose message names each bad flag
    and what it allows.
    """
    values = {name: getattr(namespace, name) for name in EngineArgs.model_fields if hasattr(namespace, name)}
    tag = getattr(namespace, "model_tag", None)
    if tag is not None:
        if values.get("model") not in (None, tag):
            raise ValueError(f"MODEL {tag!r} and --model {values['model']!r} disagree; give one of them")
        values["model"] = tag
    values.update(overrides)
    try:
        return EngineArgs(**values)
    except EngineArgsError as exc:
        raise ValueError(describe_validation_error(exc.validation_error, EngineArgs, flag_name)) from None
