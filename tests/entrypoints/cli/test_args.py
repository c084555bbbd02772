"""Engine flags generated from EngineArgs."""

from __future__ import annotations

import argparse

import pytest

from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace, flag_name


def parse(*argv: str) -> EngineArgs:
    parser = add_engine_args(argparse.ArgumentParser(exit_on_error=False))
    return engine_args_from_namespace(parser.parse_args(list(argv)))


def test_every_field_has_a_flag_with_its_description() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    for name, field in EngineArgs.model_fields.items():
        action = options[flag_name(name)]
        assert action.dest == name
        assert (field.description or "").replace("%", "%%") in action.help
    text = parser.format_help()
    assert "--no-enable-prefix-caching" in text and "-O {0,1,2,3}" in text


def test_no_flags_gives_the_defaults() -> None:
    assert parse() == EngineArgs()


def test_scalars_literals_and_enums() -> None:
    args = parse("--model", "/m", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                 "--dtype", "float16", "--cudagraph-mode", "FULL", "--kv-cache-memory", "4GiB",
                 "--block-size", "32", "--scheduling-policy", "priority")  # fmt: skip
    assert args.model == "/m"
    assert args.max_model_len == 512
    assert args.gpu_memory_utilization == 0.5
    assert args.dtype == "float16"
    assert args.cudagraph_mode is CUDAGraphMode.FULL
    assert args.kv_cache_memory == 4 * 2**30
    assert args.block_size == 32
    assert args.scheduling_policy == "priority"


def test_bool_flags_both_ways() -> None:
    assert parse("--enforce-eager").enforce_eager is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    assert parse("--normalize").normalize is True


def test_lists_and_dicts() -> None:
    assert parse("--cudagraph-capture-sizes", "8", "1", "4").cudagraph_capture_sizes == [1, 4, 8]
    assert parse("--cudagraph-capture-sizes", "1,2", "16").cudagraph_capture_sizes == [1, 2, 16]
    args = parse("--lora-modules", "a=/p/a", "b=/p/b=x")
    assert args.lora_modules == {"a": "/p/a", "b": "/p/b=x"}


@pytest.mark.parametrize("argv,level", [(["-O0"], 0), (["-O3"], 3), (["-O", "1"], 1), (["--optimization-level", "2"], 2)])
def test_optimization_level(argv: list[str], level: int) -> None:
    assert parse(*argv).optimization_level == level


def test_bad_literal_is_an_argparse_error() -> None:
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parse("--dtype", "int7")


def test_bad_key_value_is_an_argparse_error() -> None:
    with pytest.raises(argparse.ArgumentError, match="expected NAME=PATH"):
        parse("--lora-modules", "nopath")


def test_out_of_range_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization: Input should be less than or equal to 1"):
        parse("--gpu-memory-utilization", "1.5")
    with pytest.raises(ValueError, match=r"--optimization-level: Input should be less than or equal to 3"):
        parse("-O7")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        parse("--max-num-batched-tokens", "4", "--max-num-seqs", "8")


def test_skip_and_overrides() -> None:
    parser = add_engine_args(argparse.ArgumentParser(), skip=("model",))
    assert "--model" not in {o for a in parser._actions for o in a.option_strings}
    ns = parser.parse_args(["--seed", "3"])
    args = engine_args_from_namespace(ns, model="/x")
    assert args.model == "/x" and args.seed == 3


def test_list_of_strings_flag() -> None:
    from pydantic import Field, create_model

    import kvloom.entrypoints.cli.engine_args as engine_args

    extended = create_model("Extended", __base__=EngineArgs,
                            names=(list[str] | None, Field(None, description="Some names.")))  # fmt: skip
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("x")
    engine_args._add_field(group, "names", extended.model_fields["names"])
    assert parser.parse_args(["--names", "a", "b"]).names == ["a", "b"]


def test_unsupported_field_type_is_loud() -> None:
    from pydantic import create_model

    import kvloom.entrypoints.cli.engine_args as engine_args

    extended = create_model("Extended2", __base__=EngineArgs, blob=(dict[str, int] | None, None))
    group = argparse.ArgumentParser().add_argument_group("x")
    with pytest.raises(TypeError, match="EngineArgs.blob: no CLI flag rule"):
        engine_args._add_field(group, "blob", extended.model_fields["blob"])
