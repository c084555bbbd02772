"""One way to build each engine's offline ``LLM`` for the peer benchmarks, every engine at its own defaults.

kvloom and vLLM share the ``LLM(model, **kwargs).generate([{"prompt_token_ids": ...}], [SamplingParams(...)])``
interface; SGLang's offline ``sglang.Engine`` gets the same interface from ``SGLangLLM`` (token ids in, token ids
out, ``max_tokens`` as its ``max_new_tokens``), so the peer benchmarks run the same code on all three. Each gets only
the flags the workload fixes (model, dummy bf16 weights, no tokenizer, lengths, batch), recorded in every result
(``settings``): vLLM, SGLang and kvloom each at their own defaults (kvloom's defaults on CUDA are async scheduling and
the measured backend order, so it gets no attention or scheduling flag).

The vLLM side runs with ``PYTHONPATH=/tmp/vsite`` (benchmarks/peers/vllm/stash_install.sh), SGLang with
``PYTHONPATH=/tmp/sgsite`` (benchmarks/peers/sglang/stash_install.sh), kvloom with kvloom's ``/tmp/site``: never two
in one process.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "sglang", "kvloom")

#: Each engine's site (the folder on PYTHONPATH it runs from, alone), by benchmarks/peers/<engine>/stash_install.sh.
SITES = {"vllm": "/tmp/vsite", "sglang": "/tmp/sgsite"}

# kvloom's flags for the peer runs: none but stats off, as its own benchmarks run (vLLM's offline LLM logs no stats
# by default either).
KVLOOM_FLAGS: dict[str, Any] = {"disable_log_stats": True}


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise SystemExit(f"--engine: {engine!r} (allowed: {', '.join(ENGINES)})")
    return engine


def _import_peer(engine: str) -> Any:
    import importlib

    module = importlib.import_module(engine)
    # benchmarks/peers/<engine>/ (the install scripts) is a namespace package on this script's path: an installed
    # engine (a regular package) wins over it, and without one the import finds only that folder.
    if getattr(module, "__file__", None) is None:
        raise SystemExit(f"{engine} is not installed: run benchmarks/peers/{engine}/stash_install.sh, then "
                         f"PYTHONPATH={SITES[engine]}")  # fmt: skip
    return module


def engine_version(engine: str) -> str:
    if check_engine(engine) in SITES:
        return _import_peer(engine).__version__
    import kvloom

    return kvloom.__version__


class SGLangSamplingParams(dict):
    """vLLM's ``SamplingParams(temperature=..., max_tokens=..., ignore_eos=...)`` as SGLang's sampling dict."""

    def __init__(self, max_tokens: int = 16, **fields: Any) -> None:
        super().__init__(max_new_tokens=max_tokens, **fields)


class SGLangLLM:
    """``sglang.Engine`` behind vLLM's offline interface: ``generate([{"prompt_token_ids": ids}], params)`` returns
    objects whose ``outputs[0].token_ids`` are the generated ids; ``reset_prefix_cache`` is its ``flush_cache``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompts: list[dict[str, list[int]]], params: Any, use_tqdm: bool = False) -> list[Any]:
        from types import SimpleNamespace

        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = self.engine.generate(input_ids=[p["prompt_token_ids"] for p in prompts],
                                    sampling_params=[dict(p) for p in params])  # fmt: skip
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(o["output_ids"]))]) for o in outs]

    def reset_prefix_cache(self) -> None:
        self.engine.flush_cache()


def sampling_params_class(engine: str) -> Any:
    if check_engine(engine) == "vllm":
        return _import_peer("vllm").SamplingParams
    if engine == "sglang":
        return SGLangSamplingParams
    from kvloom import SamplingParams

    return SamplingParams


#: vLLM's offline flag names -> SGLang's ``Engine`` arguments, for what the workload fixes (the context, the batch).
SGLANG_ARGS = {"max_model_len": "context_length", "max_num_seqs": "max_running_requests"}
#: Shared flags that tune rather than define the workload: SGLang keeps its own defaults for them (its chunked
#: prefill size and memory fraction), as vLLM's values of them are vLLM's defaults.
SGLANG_OWN_DEFAULTS = frozenset({"max_num_batched_tokens", "gpu_memory_utilization"})


def make_llm(engine: str, model_dir: Path, **shared: Any) -> tuple[Any, dict[str, Any], float]:
    """The engine's ``LLM`` on ``model_dir`` with dummy bf16 weights, no tokenizer, ``shared`` flags (the same for
    every engine, in vLLM's names) plus the engine's own; returns it, the flags it got and its start-up time in
    seconds."""
    kwargs: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "skip_tokenizer_init": True, **shared}
    start = time.perf_counter()
    if check_engine(engine) == "vllm":
        llm = _import_peer("vllm").LLM(str(model_dir), **kwargs)
    elif engine == "sglang":
        kwargs = {SGLANG_ARGS.get(k, k): v for k, v in kwargs.items() if k not in SGLANG_OWN_DEFAULTS}
        llm = SGLangLLM(_import_peer("sglang").Engine(model_path=str(model_dir), **kwargs))
    else:
        from kvloom import LLM

        kwargs.update(KVLOOM_FLAGS)
        llm = LLM(str(model_dir), **kwargs)
    return llm, kwargs, time.perf_counter() - start


def lease_id() -> str:
    """Which lease (one machine, from its boot to its return) a result comes from: ``PEERS_LEASE`` when set, else
    the host name and the kernel's boot id (a fresh machine boots anew; a warm one keeps it). report.py never divides
    numbers from different leases."""
    given = os.environ.get("PEERS_LEASE", "").strip()
    if given:
        return given
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{platform.node()}-{boot}"


def run_header(engine: str, workload: str, version: str | None = None) -> dict[str, Any]:
    """What every peer result starts with: engine, version (``engine_version`` unless given), workload, lease, date,
    machine, command line."""
    import torch

    return {
        "engine": engine,
        "version": version or engine_version(engine),
        "workload": workload,
        "lease": lease_id(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
