"""``kvloom bench throughput``: offline throughput, optionally next to HF transformers.

    kvloom bench throughput --num-prompts 64 --input-len 128 --output-len 128 --compare-hf

Prompts are random token ids (seeded), every request generates exactly ``--output-len``
tokens (greedy, EOS ignored). With ``--compare-hf`` the same prompts go through HF
transformers' ``generate`` (same weights, same dtype, batched) right after, on the same
machine, under the same conditions as kvloom's engine: a process of its own with the
engine core's torch thread count and CPU affinity (read from the engine core, which the
CPU platform sizes by the idle cores: ``KVLOOM_CPU_THREADS`` fixes it). Both conditions
are printed and saved with the numbers; a comparison whose conditions differ is refused.
Importable: ``run_throughput(...)``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)  # keep clear of the special tokens at the start of most vocabularies
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def _hf_model(model_info: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_info["model"])
    kwargs: dict[str, Any] = {"dtype": getattr(torch, model_info["dtype"])}
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).eval()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    return model.to(torch.device(model_info["device_type"]))


def _conditions() -> dict[str, Any]:
    import torch

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS)
        cpus = list(range(os.cpu_count() or 1))
    return {"torch_threads": torch.get_num_threads(), "cpu_affinity": cpus, "pid": os.getpid()}


def _run_hf_under(conditions: dict[str, Any], model: dict[str, Any], prompts: list[list[int]], output_len: int,
                  batch_size: int, results: Any) -> None:  # fmt: skip
    """The HF run's process: first the engine core's CPU affinity and torch threads."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, conditions["cpu_affinity"])
    torch.set_num_threads(conditions["torch_threads"])
    try:
        results.put(run_hf(model, prompts, output_len, batch_size))
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def run_hf_like_the_engine(
    conditions: dict[str, Any], model: dict[str, Any], prompts: list[list[int]], output_len: int, batch_size: int
) -> dict[str, Any]:
    """``run_hf`` in a process of its own under ``conditions`` (the engine core's);
    refuses to return numbers made under other conditions."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_run_hf_under, args=(conditions, model, prompts, output_len, batch_size, results))
    process.start()
    result = results.get()
    process.join()
    if "error" in result:
        raise RuntimeError(f"the HF run failed: {result['error']}")
    same = {k: result["conditions"][k] for k in ("torch_threads", "cpu_affinity")}
    if same != {k: conditions[k] for k in ("torch_threads", "cpu_affinity")}:
        raise RuntimeError(f"HF ran under {same}, not the engine's {conditions}: the comparison would be unequal")
    return result


def run_hf(model_info: dict[str, Any], prompts: list[list[int]], output_len: int, batch_size: int) -> dict[str, Any]:
    """HF ``generate`` over ``prompts`` in this process (``model_info``: ``model``, ``dtype``,
    ``device_type``), with the conditions it ran under."""
    import torch

    model = _hf_model(model_info)
    device = next(model.parameters()).device
    # warm-up, untimed
    with torch.no_grad():
        model.generate(torch.tensor(prompts[:1], device=device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    generated = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size], device=device)  # equal lengths: no padding
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": generated, "output_tok_s": generated / wall,
            "input_tok_s": sum(map(len, prompts)) / wall, "batch_size": batch_size, "conditions": _conditions()}


def run_throughput(
    engine_kwargs: dict[str, Any],
    num_prompts: int = 64,
    input_len: int = 128,
    output_len: int = 128,
    compare_hf: bool = False,
    hf_batch_size: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark; returns a dict with the kvloom (and HF) numbers."""
    from kvloom.entrypoints.llm import LLM
    from kvloom.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs)
    config = llm.config
    conditions = llm.llm_engine.call_utility("host_conditions")
    prompts = make_prompts(num_prompts, input_len, config.model.vocab_size, seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
        # The warm-up prompts must not make the timed run a prefix-cache hit.
        llm.llm_engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.llm_engine.shutdown()  # the stat loggers' last log(); frees the engine before HF runs
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if out_tokens != num_prompts * output_len:
        raise RuntimeError(f"expected {num_prompts * output_len} output tokens, got {out_tokens}")
    result: dict[str, Any] = {
        "model": config.model.served_model_name,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "platform": config.device.platform.name,
        "attention_backend": config.attention.backend.NAME,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "kvloom": {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
                   "input_tok_s": num_prompts * input_len / wall, "conditions": conditions},
    }
    if compare_hf:
        del llm, outs
        model_info = {"model": config.model.model, "dtype": result["dtype"], "device_type": config.device.device_type}
        result["hf"] = run_hf_like_the_engine(conditions, model_info, prompts, output_len, hf_batch_size or num_prompts)
        result["speedup_output_tok_s"] = result["kvloom"]["output_tok_s"] / result["hf"]["output_tok_s"]
    return result


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name(0)}"
    return desc


def describe_conditions(conditions: dict[str, Any]) -> str:
    cpus = conditions["cpu_affinity"]
    return f"{conditions['torch_threads']} torch threads on CPUs {_ranges(cpus)} (process {conditions['pid']})"


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)


def report_header(title: str, command: str) -> list[str]:
    """The opening lines of a benchmark's markdown report (docs/benchmarks/): its title,
    today's date, this machine and the command that measured it."""
    return [f"## {title}", "", f"- Date: {datetime.date.today().isoformat()}", f"- Machine: {machine_description()}",
            f"- Command: `{command}`"]  # fmt: skip


def to_markdown(result: dict[str, Any], command: str) -> str:
    k = result["kvloom"]
    title = f"Offline throughput: {result['model']} ({result['dtype']}, {result['platform']}, {result['attention_backend']})"
    lines = [
        *report_header(title, command),
        f"- Workload: {result['num_prompts']} prompts x {result['input_len']} random tokens in, "
        f"{result['output_len']} tokens out (greedy, EOS ignored)",
        *(f"- Conditions, {name}: {describe_conditions(result[key]['conditions'])}"
          for key, name in (("kvloom", "kvloom's engine core"), ("hf", "HF transformers")) if key in result),
        "",
        "| engine | wall (s) | input tok/s | output tok/s |",
        "|---|---|---|---|",
        f"| kvloom | {k['wall_s']:.2f} | {k['input_tok_s']:.1f} | {k['output_tok_s']:.1f} |",
    ]
    if "hf" in result:
        h = result["hf"]
        lines.append(
            f"| HF transformers `generate` (batch {h['batch_size']}) | {h['wall_s']:.2f} | "
            f"{h['input_tok_s']:.1f} | {h['output_tok_s']:.1f} |"
        )
        lines += ["", f"kvloom / HF output tokens per second: **{result['speedup_output_tok_s']:.2f}x**"]
    return "\n".join(lines) + "\n"


def register(subparsers: Any) -> argparse.ArgumentParser:
    from kvloom.entrypoints.cli.engine_args import add_engine_args

    parser = subparsers.add_parser("throughput", help="Offline throughput (optionally vs HF transformers).",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--compare-hf", action="store_true", help="Also run HF transformers generate.")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch (default: all).")
    parser.add_argument("--bench-seed", type=int, default=0, help="Seed of the random prompts.")
    parser.add_argument("--json", dest="json_path", default=None, help="Write the result as JSON here.")
    parser.add_argument("--markdown", default=None, help="Append a markdown section with machine/date/command.")
    add_engine_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(ns: argparse.Namespace) -> int:
    from kvloom.entrypoints.cli.engine_args import engine_args_from_namespace

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    engine_kwargs = engine_args_from_namespace(ns).model_dump()  # every field, defaults included
    result = run_throughput(engine_kwargs, ns.num_prompts, ns.input_len, ns.output_len, ns.compare_hf,
                            ns.hf_batch_size, ns.bench_seed)
    print(json.dumps(result, indent=2))
    for key, name in (("kvloom", "kvloom's engine core"), ("hf", "HF transformers")):
        if key in result:
            print(f"{name}: {describe_conditions(result[key]['conditions'])}")
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(result, indent=2) + "\n")
    if ns.markdown:
        command = "kvloom " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        with open(ns.markdown, "a") as f:
            f.write(to_markdown(result, command) + "\n")
    return 0
