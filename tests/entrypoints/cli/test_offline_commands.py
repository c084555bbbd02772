"""``kvloom generate``, ``kvloom chat`` and ``kvloom bench throughput`` hand the user's
engine flags to ``LLM``: every ``EngineArgs`` field, given or defaulted, so that ``LLM``
runs with the values ``--help`` shows (stats on unless ``--disable-log-stats``)."""

from __future__ import annotations

import argparse
import inspect
from typing import Any

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints import llm as llm_module
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.entrypoints.cli.main import build_parser
from kvloom.entrypoints.llm import LLM
from tests.helpers.model_fixtures import tiny_model_dir

OFFLINE_COMMANDS = [["generate", "--prompt", "hello"], ["chat"], ["bench", "throughput"]]


class _Stop(Exception):
    """Raised by the stand-in LLM: the command got as far as building its engine."""


def llm_kwargs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    """The keyword arguments the command passes to ``LLM``."""
    seen: dict[str, Any] = {}

    class RecordingLLM:
        def __init__(self, model: str | None = None, **kwargs: Any) -> None:
            seen.update(kwargs, model=model)
            raise _Stop

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)
    ns = build_parser().parse_args(argv)
    with pytest.raises(_Stop):
        ns.func(ns)
    return seen


@pytest.mark.parametrize("command", OFFLINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_engine_arg_reaches_llm_defaults_included(monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    kwargs = llm_kwargs(monkeypatch, [*command, "--max-num-seqs", "8"])
    assert kwargs == {**EngineArgs().model_dump(), "max_num_seqs": 8}
    assert kwargs["disable_log_stats"] is False  # the flag's default: stats (and stat logger plugins) on
    assert llm_kwargs(monkeypatch, [*command, "--disable-log-stats"])["disable_log_stats"] is True


def test_one_default_for_disable_log_stats() -> None:
    """EngineArgs holds the default; LLM has none of its own; the CLI flag shows and uses it."""
    default = EngineArgs.model_fields["disable_log_stats"].default
    assert default is False
    assert "disable_log_stats" not in inspect.signature(LLM.__init__).parameters
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_args_from_namespace(parser.parse_args([])).disable_log_stats is default
    (action,) = [a for a in parser._actions if a.dest == "disable_log_stats"]
    assert action.help.endswith(f"(default: {default})")

    model = str(tiny_model_dir("llama"))
    llm = LLM(model, dtype="float32", kv_cache_memory="32MiB")
    assert llm.config.observability.disable_log_stats is default
    assert llm.llm_engine.log_stats is (not default)
    assert [type(s).__name__ for s in llm.llm_engine.frontend.stat_loggers][:1] == ["LoggingStatLogger"]
    quiet = LLM(model, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)  # vLLM users' spelling
    assert quiet.llm_engine.log_stats is False and quiet.llm_engine.frontend.stat_loggers == []
