"""``--reasoning-parser`` and vLLM's ``--structured-outputs-config`` reach the engine config."""

from __future__ import annotations

import argparse

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.structured_output.options import structured_outputs_config


def _structured_outputs_config(args: EngineArgs):  # what create_engine_config puts in the EngineConfig
    return structured_outputs_config(*args.structured_outputs_options())


def parse(*argv: str) -> EngineArgs:
    parser = add_engine_args(argparse.ArgumentParser())
    return engine_args_from_namespace(parser.parse_args(list(argv)))


def test_the_flags_reach_the_structured_outputs_config() -> None:
    config = _structured_outputs_config(parse("--reasoning-parser", "qwen3"))
    assert (config.backend, config.reasoning_parser, config.enable_in_reasoning) == ("xgrammar", "qwen3", False)
    args = parse("--structured-outputs-config", '{"reasoning_parser": "deepseek_r1", "enable_in_reasoning": true}')
    config = _structured_outputs_config(args)
    assert (config.reasoning_parser, config.enable_in_reasoning) == ("deepseek_r1", True)
    assert _structured_outputs_config(EngineArgs()).reasoning_parser is None


def test_bad_values_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--structured-outputs-config: .*unknown key\(s\) 'grammar' \(allowed: backend"):
        parse("--structured-outputs-config", '{"grammar": 1}')
    with pytest.raises(ValueError, match="enable_in_reasoning must be a bool"):
        parse("--structured-outputs-config", '{"enable_in_reasoning": "yes"}')
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' disagrees with --reasoning-parser 'deepseek_r1'"):
        parse("--reasoning-parser", "deepseek_r1", "--structured-outputs-config", '{"reasoning_parser": "qwen3"}')
    with pytest.raises(SystemExit):
        parse("--structured-outputs-config", "[1]")
    with pytest.raises(ValueError, match=r"unknown parser 'r2' \(available: deepseek_r1, qwen3\)"):
        _structured_outputs_config(parse("--reasoning-parser", "r2"))
