"""The command line the Triton kernel benchmarks share (``bench_fused_moe.py``,
``bench_sampler.py``): the same flags, and ``--device cpu`` as a smoke test that runs the
kernels in Triton's interpreter."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch


def kernel_bench_parser(doc: str | None, batches: str) -> argparse.ArgumentParser:
    """``--out``, ``--device``, ``--batches`` (default ``batches``), ``--dtype``,
    ``--warmup-ms``, ``--rep-ms``; the caller adds its own flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=200)
    return parser


def kernel_bench_device(args: argparse.Namespace) -> torch.device:
    """The device of ``args.device``, logging set up. Call it before importing the module
    that defines the kernels: on the CPU they must be defined under ``TRITON_INTERPRET=1``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (use --device cpu for the smoke test)")
    return device


def write_result(out: str, result: dict) -> None:
    """``result`` as indented JSON at ``out`` (its folder made), logged."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    logging.getLogger(__name__).info("wrote %s", path)
