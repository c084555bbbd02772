"""C kernels of kvloom's CPU plugins, built once per machine and loaded with ``ctypes``.

A plugin ships its kernels as one C source file (plain C with OpenMP; AVX2 intrinsics
behind ``#ifdef __AVX2__``), which may include ``kvloom_native.h`` (helpers that every
kernel file would otherwise write again, e.g. ``thread_scratch``).
``load_c_library(source)`` compiles it with the system C compiler (``$CC``, else ``cc``) on
first use into ``KVLOOM_CACHE_DIR/c-kernels/`` (a file named by the source, the header, the
flags and the compiler's version, so that any change rebuilds it; a second or two) and
loads it. OpenMP is the runtime torch already loaded
(``libgomp.so.1``), so kernels and torch share one thread pool; callers pass
``torch.get_num_threads()``. ``c_build_problem(source)`` says why a library cannot be had
here (no compiler and nothing built), for a plugin's validation to report;
``try_load_c_library(source, fallback)`` loads it or warns of that and returns None.
``prepare_c_library(source)`` starts a build in the background (a compiler process beside
this one) for a plugin that knows it will need the library soon, e.g. while the model's
weights load: ``load_c_library`` then finds it built or waits for that build (a cold start
of the default GGUF model compiles ~3 s of kernels; this way on the otherwise idle core).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvloom.utils import kvloom_cache_dir

logger = logging.getLogger(__name__)


def c_compiler() -> str | None:
    """The C compiler kernels are built with (``$CC`` or ``cc``), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def cpu_simd() -> str:
    """``"avx2"`` where torch finds AVX2 (or AVX-512) on this CPU, else ``"portable"``."""
    return "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "portable"


#: The header of helpers every plugin's C source may include (``#include "kvloom_native.h"``).
NATIVE_HEADER = Path(__file__).with_name("kvloom_native.h")


def c_flags() -> list[str]:
    vector = ["-mavx2", "-mfma", "-mf16c"] if cpu_simd() == "avx2" else []
    # No FMA contraction of scalar code: kernels that must round as torch does (two
    # roundings for a * b + c) get them.
    return ["-O3", *vector, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", f"-I{NATIVE_HEADER.parent}"]


@functools.cache
def c_library_path(source: Path) -> Path:
    """Where the library built from ``source`` is cached for these flags and this compiler."""
    cc = c_compiler() or "cc"
    try:
        version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    inputs = source.read_bytes() + NATIVE_HEADER.read_bytes() + " ".join(c_flags()).encode() + version.encode()
    key = hashlib.sha256(inputs).hexdigest()[:16]
    return kvloom_cache_dir() / "c-kernels" / f"{source.stem}_{cpu_simd()}_{key}.so"


def c_build_problem(source: Path) -> str | None:
    """Why the kernels of ``source`` cannot be had here (no C compiler, none built), or None."""
    if c_compiler() is None and not c_library_path(source).is_file():
        return (f"no C compiler to build the CPU kernels of {source.name} ({os.environ.get('CC', 'cc')} not found; "
                "install gcc)")  # fmt: skip
    return None


#: Builds started by ``prepare_c_library`` and not yet waited for: (pid of the process that
#: started it, source) -> (compiler, temp file). A forked child cannot wait for its parent's
#: compiler: it builds again, and the atomic rename keeps one complete file.
_pending: dict[tuple[int, Path], tuple[subprocess.Popen, str]] = {}


def _start_build(source: Path, target: Path) -> tuple[subprocess.Popen, str]:
    cc = c_compiler()
    if cc is None:
        raise RuntimeError(c_build_problem(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    logger.info("Building the CPU kernels of %s (%s, once) into %s", source.name, cpu_simd(), target)
    command = [cc, *c_flags(), str(source), "-o", tmp, "-lm"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), tmp


def _finish_build(source: Path, target: Path, build: tuple[subprocess.Popen, str]) -> None:
    process, tmp = build
    _, stderr = process.communicate()
    if process.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source.name} with {process.args[0]} failed:\n{stderr[-4000:]}")
    os.replace(tmp, target)  # atomic: a concurrent build ends with one complete file


def prepare_c_library(source: Path) -> None:
    """Start building the kernels of the C file ``source`` in the background unless they
    are built (or being built) already, or no compiler is here (``load_c_library`` then
    says why). Returns at once; ``load_c_library`` waits for the build (a process that
    never loads it finishes the build as it exits: no compiler left running, no temp file)."""
    source = Path(source).resolve()
    if (os.getpid(), source) in _pending or c_compiler() is None or c_library_path(source).is_file():
        return
    _pending[os.getpid(), source] = _start_build(source, c_library_path(source))


@atexit.register
def _finish_unloaded_builds() -> None:
    """At exit: wait for this process's builds nobody loaded and keep them (the next start
    finds them built); a failed one only removes its temp file (its error is the next
    load's to report)."""
    for key in [k for k in _pending if k[0] == os.getpid()]:
        source = key[1]
        try:
            _finish_build(source, c_library_path(source), _pending.pop(key))
        except RuntimeError:
            pass


def try_load_c_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """``load_c_library(source)``, or None where it cannot be had here (no compiler, nothing
    built), with one warning that names the problem and ``fallback``, what runs instead."""
    problem = c_build_problem(source)
    if problem is not None:
        logger.warning("%s; %s", problem, fallback)
        return None
    return load_c_library(source)


def load_c_library(source: Path) -> ctypes.CDLL:
    """The kernels of the C file ``source``, built on first use (see the module docstring),
    loaded once per process. The caller declares each function's ``argtypes`` and ``restype``."""
    return _load(Path(source).resolve())


@functools.cache
def _load(source: Path) -> ctypes.CDLL:
    path = c_library_path(source)
    build = _pending.pop((os.getpid(), source), None)
    if build is not None:
        _finish_build(source, path, build)
    elif not path.is_file():
        _finish_build(source, path, _start_build(source, path))
    return ctypes.CDLL(str(path))
