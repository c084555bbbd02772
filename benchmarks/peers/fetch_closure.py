#!/usr/bin/env python3
"""Download a peer engine and everything it requires that the GPU image lacks, as wheels
for CPython 3.12 on manylinux x86-64 (run on the CPU machine, which has pip access).

    python3 benchmarks/peers/fetch_closure.py --out .sglang/wheels "sglang==0.5.15.post1" flashinfer-cubin==0.6.12

Each requirement is downloaded with ``pip download --no-deps`` and its wheel's own
``Requires-Dist`` lines are followed (markers evaluated for Linux x86-64 and Python 3.12,
extras honoured), except for the packages the GPU image already has (``IMAGE``: torch and
everything its CUDA 13 wheel depends on, triton, transformers and its dependencies, ...),
which must not be replaced. The first version that satisfies a name wins; a later
specifier it does not satisfy is reported. Writes ``closure.json`` beside the wheels
(every wheel, its size, who required it, and what could not be fetched) and prints the
total size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

#: What the GPU image has (torch 2.11.0+cu130 and its dependencies, triton 3.6,
#: transformers and its dependencies, the test tools): never downloaded, never replaced.
IMAGE = frozenset(canonicalize_name(n) for n in (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "numpy",
    "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "typing-extensions", "setuptools",
    "packaging", "pyyaml", "regex", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm",
    "pluggy", "prometheus-client", "pytest", "httpx", "httpcore", "anyio", "sniffio", "h11", "uvloop",
    "cuda-bindings", "cuda-pathfinder", "cuda-toolkit",
))  # fmt: skip
#: Prefixes of the CUDA runtime wheels torch brings (nvidia-cublas-cu13, nvidia-nccl-cu13, ...).
IMAGE_PREFIXES = ("nvidia-cublas", "nvidia-cuda-", "nvidia-cudnn-cu", "nvidia-cufft", "nvidia-cufile",
                  "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nccl", "nvidia-nvjitlink",
                  "nvidia-nvtx", "nvidia-nvshmem")  # fmt: skip

PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[x for p in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                          "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64",
                          "any") for x in ("--platform", p)]]  # fmt: skip
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # fmt: skip


def in_image(name: str) -> bool:
    name = canonicalize_name(name)
    return name in IMAGE or name.startswith(IMAGE_PREFIXES)


def applies(marker: Marker | None, extras: set[str]) -> bool:
    if marker is None:
        return True
    return any(marker.evaluate({**ENVIRONMENT, "extra": extra}) for extra in (extras or {""}))


def requirements_of(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", errors="replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _pip_download(specs: list[str], out: Path) -> bool:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(out),
                           *specs], capture_output=True, text=True, check=False)  # fmt: skip
    return done.returncode == 0


def download(specs: list[str], out: Path) -> dict[str, Path | None]:
    """``pip download --no-deps`` of ``specs`` into ``out`` (one pip call; one per spec when
    that fails, to find the culprits): each spec's wheel, or None."""
    if not _pip_download(specs, out) and len(specs) > 1:
        for spec in specs:
            _pip_download([spec], out)
    wheels = {parse_wheel_filename(w.name)[0]: w for w in sorted(out.glob("*.whl"), key=lambda w: w.stat().st_mtime)}
    return {spec: wheels.get(canonicalize_name(Requirement(spec).name)) for spec in specs}


def fetch(roots: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    have: dict[str, tuple[str, Path]] = {}  # name -> (version, wheel)
    required_by: dict[str, list[str]] = {}
    conflicts, missing = [], []
    wave: list[tuple[str, str]] = [(spec, "(asked)") for spec in roots]
    while wave:  # breadth first: one pip call per wave of new names
        fresh: dict[str, tuple[Requirement, str]] = {}
        for spec, parent in wave:
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            if in_image(name):
                continue
            required_by.setdefault(name, []).append(parent)
            if name in have:
                version = have[name][0]
                if req.specifier and not req.specifier.contains(version, prereleases=True):
                    conflicts.append(f"{parent} wants {spec}, have {name} {version}")
            elif name in fresh:
                fresh[name][0].extras.update(req.extras)
            else:
                fresh[name] = (req, parent)
        wave = []
        got = download([f"{req.name}{req.specifier}" for req, _ in fresh.values()], out)
        for (req, parent), wheel in zip(fresh.values(), got.values()):
            if wheel is None:
                missing.append(f"{req} (for {parent}): no wheel for CPython 3.12 on manylinux x86-64")
                continue
            name, version = canonicalize_name(req.name), str(parse_wheel_filename(wheel.name)[1])
            have[name] = (version, wheel)
            print(f"{name} {version} ({wheel.stat().st_size / 2**20:.1f} MiB) for {parent}", flush=True)
            for dep in requirements_of(wheel):
                dep_req = Requirement(dep)
                if applies(dep_req.marker, set(req.extras)):
                    extras = f"[{','.join(sorted(dep_req.extras))}]" if dep_req.extras else ""
                    wave.append((f"{dep_req.name}{extras}{dep_req.specifier}", f"{name} {version}"))
    wheels = sorted(((w.name, w.stat().st_size) for _, w in have.values()), key=lambda x: -x[1])
    total = sum(size for _, size in wheels)
    summary = {"asked": roots, "total_bytes": total, "wheels": [{"file": f, "bytes": s} for f, s in wheels],
               "required_by": required_by, "conflicts": conflicts, "missing": missing,
               "image_packages_left_out": sorted(IMAGE)}  # fmt: skip
    (out.parent / "closure.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(wheels)} wheels, {total / 2**20:.0f} MiB; largest: "
          + ", ".join(f"{f} {s / 2**20:.0f} MiB" for f, s in wheels[:6]))
    for line in conflicts + missing:
        print(f"WARNING: {line}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="Folder for the wheels (an ignored one).")
    parser.add_argument("specs", nargs="+", help="What to fetch, e.g. vllm==0.26.0")
    args = parser.parse_args()
    summary = fetch(args.specs, args.out)
    sys.exit(1 if summary["missing"] else 0)


if __name__ == "__main__":
    main()
