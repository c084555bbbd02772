#!/usr/bin/env python3
"""Download a peer engine and everything it requires that the GPU image must keep its own of, as wheels for
CPython 3.12 on manylinux x86-64 (run on the CPU machine, which has pip access).

    python3 benchmarks/peers/fetch_closure.py --out .sglang/wheels "sglang==0.5.15.post1" flashinfer-cubin==0.6.12

The asked packages are downloaded alone, then pip resolves the requirements their wheels declare for that target
(``pip download`` with its resolver: the versions fit each other); ``--without NAME`` leaves out a requirement that
no version on the index satisfies (recorded: the peer runs without it unless it imports it), then the wheels of the GPU image's CUDA stack are dropped (``CUDA_STACK``: torch 2.11.0+cu130 and the CUDA
libraries it loads, triton), which the peer must use as the image has them: the peer's site holds everything else,
first on its ``PYTHONPATH``. A peer that pins torch to another version than the image's is refused. Writes
``closure.json`` beside the wheels (every wheel and its size, what was dropped) and prints the total size.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

#: The torch the GPU image has: a peer must pin this one (its CUDA stack is the image's).
IMAGE_TORCH = "2.11.0"
#: The GPU image's CUDA stack: torch, triton and the CUDA runtime wheels torch loads; never carried or replaced.
CUDA_STACK = frozenset(canonicalize_name(n) for n in ("torch", "triton", "cuda-bindings", "cuda-pathfinder",
                                                      "cuda-toolkit"))  # fmt: skip
CUDA_STACK_PREFIXES = ("nvidia-cublas", "nvidia-cuda-", "nvidia-cudnn-cu", "nvidia-cufft", "nvidia-cufile",
                       "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nccl", "nvidia-nvjitlink",
                       "nvidia-nvtx", "nvidia-nvshmem")  # fmt: skip

PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[x for p in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                          "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64",
                          "any") for x in ("--platform", p)]]  # fmt: skip


ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip


def in_cuda_stack(name: str) -> bool:
    name = canonicalize_name(name)
    return name in CUDA_STACK or name.startswith(CUDA_STACK_PREFIXES)


_MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)==([^\s;]+)")


def _stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel with metadata only: it stands, during resolution, for a CUDA-stack package the index lacks (the
    image has its own; CUDA-stack wheels are dropped from what is carried)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for n, text in files.items():
            z.writestr(n, text)


def _pip_download(args: list[str], into: str, stubs: Path) -> None:
    """``pip download`` of ``args`` into ``into``; a CUDA-stack package the index lacks is stubbed and tried again."""
    for _ in range(40):
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "--find-links", str(stubs),
                               "-d", into, *args], capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode == 0:
            return
        missing = _MISSING.search(done.stdout + done.stderr)
        if missing is None or not in_cuda_stack(missing.group(1)):
            break
        # A pin may be a prefix ("==13.0.85.*"): the stub takes the version it names.
        _stub_wheel(stubs, missing.group(1), missing.group(2).removesuffix(".*"))
    raise SystemExit(f"pip download {' '.join(args)[:300]} failed for CPython 3.12 on manylinux x86-64:\n"
                     f"{(done.stdout + done.stderr)[-4000:]}")  # fmt: skip


def declared_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply on Linux x86-64 with Python 3.12, no extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", errors="replace").splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENVIRONMENT)]


def fetch(specs: list[str], out: Path, without: list[str] = ()) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    left_out = {canonicalize_name(n) for n in without}
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        asked, stubs = Path(tmp) / "asked", Path(tmp) / "stubs"
        _pip_download(["--no-deps", *specs], str(asked), stubs)
        wanted = [r for wheel in sorted(asked.glob("*.whl")) for r in declared_requirements(wheel)
                  if canonicalize_name(r.name) not in left_out]  # fmt: skip
        _pip_download([str(Requirement(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}"
                                       f"{r.specifier}")) for r in wanted], tmp, stubs)  # fmt: skip
        for wheel in asked.glob("*.whl"):
            shutil.move(str(wheel), Path(tmp) / wheel.name)
        kept, dropped = [], []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            name, version = parse_wheel_filename(wheel.name)[:2]
            if name == "torch" and str(version).split("+")[0] != IMAGE_TORCH:
                raise SystemExit(f"{specs} need torch {version}; the GPU image has {IMAGE_TORCH}: it cannot run there")
            if in_cuda_stack(name):
                dropped.append(f"{name} {version}")
                continue
            kept.append((wheel.name, wheel.stat().st_size))
            shutil.move(str(wheel), out / wheel.name)
    kept.sort(key=lambda x: -x[1])
    total = sum(size for _, size in kept)
    summary = {"asked": specs, "left_out": sorted(left_out), "total_bytes": total,
               "wheels": [{"file": f, "bytes": s} for f, s in kept], "dropped_image_cuda_stack": dropped}  # fmt: skip
    (out.parent / "closure.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(kept)} wheels, {total / 2**20:.0f} MiB (the image's CUDA stack left out: {len(dropped)} wheels); "
          "largest: " + ", ".join(f"{f} {s / 2**20:.0f} MiB" for f, s in kept[:8]))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="Folder for the wheels (an ignored one).")
    parser.add_argument("--without", action="append", default=[], metavar="NAME",
                        help="A declared requirement to leave out (no version on the index satisfies it).")  # fmt: skip
    parser.add_argument("specs", nargs="+", help="What to fetch, e.g. vllm==0.26.0")
    args = parser.parse_args()
    fetch(args.specs, args.out, args.without)


if __name__ == "__main__":
    main()
