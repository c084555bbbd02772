"""benchmarks/run_spec.py: the NAME+option run specs the benchmarks share (+tpN included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "run_spec", Path(__file__).resolve().parents[2] / "benchmarks/run_spec.py"
)
run_spec = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run_spec)


def test_name_options_and_tensor_parallel_size() -> None:
    assert run_spec.parse_run_spec("TRITON_ATTN+async+tp2", ("async", "noops")) == ("TRITON_ATTN", {"async"}, 2)
    assert run_spec.parse_run_spec("graphs", ("async",)) == ("graphs", set(), 1)


@pytest.mark.parametrize("spec", ["X+foo", "X+tp2+tp4", "X+tp0", "X+tp"])
def test_unknown_options_name_the_allowed_ones(spec: str) -> None:
    with pytest.raises(ValueError, match=r"allowed: \+async, \+noops, one \+tpN"):
        run_spec.parse_run_spec(spec, ("async", "noops"))


@pytest.mark.parametrize(("options", "expected"), [({"compile"}, True), ({"nocompile"}, False), ({"async"}, None)])
def test_the_compile_options_set_torch_compile(options: set[str], expected: bool | None) -> None:
    assert run_spec.torch_compile_option("X", options) is expected


def test_compile_and_nocompile_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'X\+compile\+nocompile': \+compile and \+nocompile contradict"):
        run_spec.torch_compile_option("X+compile+nocompile", {"compile", "nocompile"})
