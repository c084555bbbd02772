"""One way to build either engine's offline ``LLM`` for the peer benchmarks, each at its recommended fast settings.

kvloom and vLLM share the ``LLM(model, **kwargs).generate([{"prompt_token_ids": ...}], [SamplingParams(...)])``
interface, so the peer benchmarks run the same code on both; only the constructor's flags differ, and they are
recorded in every result (``settings``):

- vLLM: its defaults (``-O2``: torch.compile with FULL_AND_PIECEWISE CUDA graphs, its own attention backend
  selection, its default scheduling), no tokenizer (prompts are token ids).
- kvloom: ``TRITON_ATTN`` with ``async_scheduling`` and CUDA graphs (the fastest configuration in
  docs/benchmarks/gpu_h100.md), stats logging off as in kvloom's own benchmarks.

The vLLM side runs with ``PYTHONPATH=/tmp/vsite`` (benchmarks/peers/vllm/stash_install.sh), the kvloom side with
kvloom's ``/tmp/site``: never both in one process.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "kvloom")

# kvloom's flags for the peer runs (its fastest H100 configuration); vLLM gets none beyond the shared ones.
KVLOOM_FLAGS: dict[str, Any] = {"attention_backend": "TRITON_ATTN", "async_scheduling": True, "disable_log_stats": True}


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise SystemExit(f"--engine: {engine!r} (allowed: {', '.join(ENGINES)})")
    return engine


def _import_vllm() -> Any:
    import vllm

    # benchmarks/peers/vllm/ (the install scripts) is a namespace package on this script's path: an installed vLLM
    # (a regular package) wins over it, and without one ``import vllm`` would find only that folder.
    if getattr(vllm, "__file__", None) is None:
        raise SystemExit(
            "vLLM is not installed: run benchmarks/peers/vllm/stash_install.sh, then PYTHONPATH=/tmp/vsite"
        )
    return vllm


def engine_version(engine: str) -> str:
    if check_engine(engine) == "vllm":
        return _import_vllm().__version__
    import kvloom

    return kvloom.__version__


def sampling_params_class(engine: str) -> Any:
    if check_engine(engine) == "vllm":
        return _import_vllm().SamplingParams
    from kvloom import SamplingParams

    return SamplingParams


def make_llm(engine: str, model_dir: Path, **shared: Any) -> tuple[Any, dict[str, Any], float]:
    """The engine's ``LLM`` on ``model_dir`` with dummy bf16 weights, no tokenizer, ``shared`` flags (the same for
    both engines) plus the engine's own; returns it, the flags it got and its start-up time in seconds."""
    kwargs: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "skip_tokenizer_init": True, **shared}
    if check_engine(engine) == "vllm":
        LLM = _import_vllm().LLM
    else:
        from kvloom import LLM

        kwargs.update(KVLOOM_FLAGS)
    start = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    return llm, kwargs, time.perf_counter() - start


def run_header(engine: str, workload: str, version: str | None = None) -> dict[str, Any]:
    """What every peer result starts with: engine, version (``engine_version`` unless given), workload, date,
    machine, command line."""
    import torch

    return {
        "engine": engine,
        "version": version or engine_version(engine),
        "workload": workload,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
