"""kvloom.native: CPU plugins' C files built once per machine into KVLOOM_CACHE_DIR and
loaded with ctypes; a build started early (``prepare_c_library``) is the one a later load
waits for."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from kvloom import native
from kvloom.interfaces import c_build_problem, load_c_library, prepare_c_library, try_load_c_library

pytestmark = pytest.mark.skipif(native.c_compiler() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))


def _source(tmp_path: Path, body: str) -> Path:
    source = tmp_path / "kernel.c"
    source.write_text(body)
    return source


def test_a_prepared_build_is_the_one_the_load_waits_for(tmp_path):
    source = _source(tmp_path, "int twice(int x) { return 2 * x; }\n")
    target = native.c_library_path(source.resolve())
    prepare_c_library(source)
    assert (os.getpid(), source.resolve()) in native._pending and not target.is_file()  # building beside this process
    prepare_c_library(source)  # once
    lib = load_c_library(source)
    lib.twice.argtypes, lib.twice.restype = [ctypes.c_int], ctypes.c_int
    assert lib.twice(21) == 42
    assert target.is_file() and (os.getpid(), source.resolve()) not in native._pending
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary file left
    prepare_c_library(source)  # built: nothing to start
    assert (os.getpid(), source.resolve()) not in native._pending


def test_a_failed_build_says_what_the_compiler_said(tmp_path):
    source = _source(tmp_path, "int broken( { return; }\n")
    prepare_c_library(source)
    with pytest.raises(RuntimeError, match="building kernel.c with .* failed:\n.*error"):
        load_c_library(source)
    assert not any(native.c_library_path(source.resolve()).parent.iterdir())


def test_without_a_compiler_prepare_does_nothing_and_the_problem_is_named(tmp_path, monkeypatch):
    source = _source(tmp_path, "int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", "no-such-compiler-kvloom")
    prepare_c_library(source)
    assert (os.getpid(), source.resolve()) not in native._pending
    assert "no C compiler to build the CPU kernels of kernel.c (no-such-compiler-kvloom not found" in (
        c_build_problem(source) or "")


def test_a_process_that_never_loads_its_prepared_build_keeps_it_at_exit(tmp_path):
    """A child prepares two builds (one broken) and exits without loading either: the good one
    is in the cache afterwards, and no temporary file or compiler is left behind."""
    import subprocess
    import sys

    good = _source(tmp_path, "int one(void) { return 1; }\n")
    bad = tmp_path / "broken.c"
    bad.write_text("int broken( {\n")
    script = ("import sys; from pathlib import Path; from kvloom.interfaces import prepare_c_library; "
              "[prepare_c_library(Path(a)) for a in sys.argv[1:]]")  # fmt: skip
    subprocess.run([sys.executable, "-c", script, str(good), str(bad)], check=True, timeout=120, env=os.environ.copy())
    built = native.c_library_path(good.resolve())
    assert built.is_file()
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name]


def test_try_load_warns_of_the_problem_and_the_fallback_or_loads(tmp_path, monkeypatch, caplog):
    source = _source(tmp_path, "int one(void) { return 1; }\n")
    lib = try_load_c_library(source, "torch runs instead")
    lib.one.restype = ctypes.c_int
    assert lib.one() == 1
    other = tmp_path / "other.c"
    other.write_text("int two(void) { return 2; }\n")
    monkeypatch.setenv("CC", "no-such-compiler-kvloom")
    with caplog.at_level("WARNING", logger="kvloom.native"):
        assert try_load_c_library(other, "torch runs instead") is None
    assert "no C compiler to build the CPU kernels of other.c" in caplog.text and "torch runs instead" in caplog.text
