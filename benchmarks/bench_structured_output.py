#!/usr/bin/env python3
"""Structured-output overhead at batch 64 (issue 21's GPU acceptance).

The Qwen3-0.6B shape with random (dummy) bf16 weights and a real tokenizer's vocabulary
(``--tokenizer``: its files are copied beside the config, and the config's ``vocab_size``
is the tokenizer's, so grammars see real token strings). ``--batch`` requests with
``--prompt-len`` random prompt tokens run twice on one engine, greedy:

* constrained: every request follows ``SCHEMA`` (nested objects, an array of objects,
  enums, integers with ranges, letters-only strings and arrays bounded by patterns and
  maxItems; no free whitespace, so the output is bounded and each request ends when its
  grammar terminates, well inside ``--max-tokens``);
* unconstrained: the same prompts, ``ignore_eos`` and ``max_tokens`` equal to the
  constrained run's mean output length, so both runs decode over comparable contexts.

Method. The engine core runs in this process (``KVLOOM_ENABLE_MULTIPROCESSING=0``) and
the benchmark calls ``LLMEngine.step()`` itself, timing each call (schedule + forward +
bitmask + sampling + output processing; with async scheduling a call launches step n+1
and returns once step n's tokens are on the host). ``Scheduler.schedule`` is wrapped to
record what each step runs; the decode step time is the **median over the steps that
decode all ``--batch`` requests, one token each** (steps with a prefill, and the tail
where finished requests thin the batch, are left out). The ratio is constrained /
unconstrained median, per scheduling mode. Separately:

* the bitmask fill: ``StructuredOutputManager.grammar_bitmask`` wrapped (host time to
  advance the matchers to the output tokens and fill one row per request: in
  ``schedule()`` when synchronous; with async scheduling after step n's tokens are
  applied, while the device runs the forward of step n+1), median over full-batch steps;
* the bitmask apply: ``apply_grammar_bitmask`` in the model runner wrapped (host time
  of the call, and on CUDA the device time between CUDA events around it), median over
  full-batch steps;
* grammar compile time of ``SCHEMA`` through the engine core's manager before any batch
  runs: the backend's tokenizer info (once per engine), the cold compile (submit to
  ready) and the cached lookup of a second request with the same schema;
* ``--modes sync,async``: one engine per mode (``async_scheduling`` off / on). Their
  greedy constrained (and unconstrained) tokens are compared request by request, and the
  number of steps in flight between ``step()`` calls is recorded per run: with async
  scheduling a decode keeps one step in flight, constrained or not (the forward of step
  n+1 is launched before step n's tokens are back; its sampling waits for the bitmask
  that follows them), which the JSON states under ``async_constrained_overlaps`` and
  ``structured_requests_force_synchronous_steps`` (false when a step stays in flight).

Every constrained output is checked against ``SCHEMA`` (``kvloom.testing.json_schema``).

    python benchmarks/bench_structured_output.py --tokenizer .benchtok --out $OUT
    python benchmarks/bench_structured_output.py --tokenizer DIR --shape tiny --device cpu --dtype float32 \\
        --batch 4 --max-tokens 400 --out /tmp/so   # the CPU smoke run

Writes ``structured_output.json`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline_nanovllm import write_qwen3_config  # noqa: E402

logger = logging.getLogger("bench_structured_output")

#: Step-time target of the acceptance: constrained within this factor of unconstrained.
TARGET_RATIO = 1.15

#: A tiny Qwen3 for the CPU smoke run (``--shape tiny``).
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def _letters(n: int) -> dict[str, Any]:
    # xgrammar does not apply maxLength to a string with a pattern: the pattern bounds it.
    return {"type": "string", "maxLength": n, "pattern": f"^[A-Za-z]{{1,{n}}}$"}


def _obj(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


#: A moderately large schema: 23 properties over three levels of nesting, an array of
#: objects, enums, ranges and bounded strings and arrays.
SCHEMA: dict[str, Any] = _obj(
    order_id={"type": "string", "maxLength": 8, "pattern": "^[A-Z]{2}[0-9]{6}$"},
    status={"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    priority={"type": "integer", "minimum": 1, "maximum": 5},
    customer=_obj(
        name=_letters(12),
        email={"type": "string", "maxLength": 21, "pattern": "^[a-z]{1,8}@[a-z]{1,8}[.](com|org|net)$"},
        tier={"type": "string", "enum": ["free", "pro", "enterprise"]},
        address=_obj(street=_letters(16), city=_letters(12),
                     country={"type": "string", "enum": ["NO", "SE", "DE", "FR", "US", "JP"]},
                     zip={"type": "string", "maxLength": 5, "pattern": "^[0-9]{5}$"}),
    ),
    items={"type": "array", "minItems": 1, "maxItems": 4, "items": _obj(
        sku={"type": "string", "maxLength": 8, "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        quantity={"type": "integer", "minimum": 1, "maximum": 99},
        category={"type": "string", "enum": ["book", "toy", "food", "tool", "garment"]},
        gift={"type": "boolean"},
    )},
    tags={"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6, "pattern": "^[a-z]{1,6}$"}},
    shipping=_obj(method={"type": "string", "enum": ["ground", "air", "express"]}, insured={"type": "boolean"},
                  days={"type": "integer", "minimum": 1, "maximum": 30}),
    notes=_letters(20),
)  # fmt: skip


def model_dir_with_tokenizer(root: Path, tokenizer_dir: Path, shape: str) -> tuple[Path, Any]:
    """The Qwen3 config (``shape``: ``qwen3-0.6b`` or ``tiny``) with the tokenizer's
    vocabulary, and the tokenizer files beside it; also the loaded tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = TINY_SHAPE if shape == "tiny" else {}
    model_dir = write_qwen3_config(root / f"qwen3-{shape}-so", vocab_size=len(tokenizer), **sizes)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, model_dir / f.name)
    return model_dir, tokenizer


class StepRecorder:
    """Wraps the in-process engine core to record, per ``LLMEngine.step()``, its wall time
    and what ``schedule()`` put in it, plus the bitmask fill and apply times."""

    def __init__(self, llm: Any, device: torch.device) -> None:
        from kvloom.worker import model_runner

        self.engine = llm.llm_engine
        self.core = self.engine.engine_core.core
        self.device = device
        self.steps: list[dict[str, Any]] = []
        self.fills: list[tuple[int, float]] = []  # (rows, host seconds)
        self.applies: list[tuple[int, float, Any, Any]] = []  # (rows, host seconds, start event, end event)
        self._scheduled: dict[str, Any] | None = None
        scheduler, manager = self.core.scheduler, self.core.structured_output_manager
        self._restore: list[tuple[Any, str, Any]] = [
            (scheduler, "schedule", scheduler.schedule),
            (manager, "grammar_bitmask", manager.grammar_bitmask),
            (model_runner, "apply_grammar_bitmask", model_runner.apply_grammar_bitmask),
        ]
        scheduler.schedule = self._wrap_schedule(scheduler.schedule)
        manager.grammar_bitmask = self._wrap_fill(manager.grammar_bitmask)
        model_runner.apply_grammar_bitmask = self._wrap_apply(model_runner.apply_grammar_bitmask)

    def _wrap_schedule(self, schedule: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped() -> Any:
            out = schedule()
            self._scheduled = {"reqs": len(out.num_scheduled_tokens), "tokens": out.total_num_scheduled_tokens,
                               "bitmask_rows": len(out.structured_output_request_ids)}  # fmt: skip
            return out

        return wrapped

    def _wrap_fill(self, fill: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(requests: list[Any], *args: Any) -> Any:  # args: the step's drafts (speculation)
            start = time.perf_counter()
            result = fill(requests, *args)
            self.fills.append((len(requests), time.perf_counter() - start))
            return result

        return wrapped

    def _wrap_apply(self, apply: Callable[..., None]) -> Callable[..., None]:
        cuda = self.device.type == "cuda"

        def wrapped(logits: torch.Tensor, req_ids: list[str], rows: dict[str, int], bitmask: torch.Tensor) -> None:
            begin = end = None
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            apply(logits, req_ids, rows, bitmask)
            host = time.perf_counter() - start
            if cuda:
                end.record()
            self.applies.append((len(rows), host, begin, end))

        return wrapped

    def step(self) -> list[Any]:
        """One ``LLMEngine.step()``, recorded."""
        self._scheduled = None
        start = time.perf_counter()
        outputs = self.engine.step()
        self.steps.append({"s": time.perf_counter() - start, "scheduled": self._scheduled,
                           "in_flight_after": len(getattr(self.core, "_in_flight", ()))})  # fmt: skip
        return outputs

    def reset(self) -> None:
        self.steps, self.fills, self.applies = [], [], []

    def close(self) -> None:
        for owner, name, original in self._restore:
            setattr(owner, name, original)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(values: Sequence[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def run_batch(recorder: StepRecorder, prompts: list[list[int]], params: Any, tag: str,
              batch: int) -> dict[str, Any]:  # fmt: skip
    """Run ``prompts`` with ``params`` to completion, one recorded step at a time; the
    statistics of the steps that decode the whole batch."""
    engine = recorder.engine
    recorder.reset()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    finished: dict[str, Any] = {}
    _sync(recorder.device)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in recorder.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    _sync(recorder.device)
    wall = time.perf_counter() - start
    outputs = [finished[f"{tag}-{i}"] for i in range(len(prompts))]
    rows = batch if params.structured_outputs is not None else 0
    full = [s for s in recorder.steps if s["scheduled"] == {"reqs": batch, "tokens": batch, "bitmask_rows": rows}]
    device_apply = []
    if recorder.device.type == "cuda":
        device_apply = [begin.elapsed_time(end) / 1e3 for rows, _, begin, end in recorder.applies if rows == batch]
    return {
        "wall_s": wall,
        "steps": len(recorder.steps),
        "full_batch_steps": len(full),
        "step_ms_median": _median_ms([s["s"] for s in full]),
        "step_ms_min": 1e3 * min(s["s"] for s in full) if full else None,
        "max_in_flight_between_full_steps": max((s["in_flight_after"] for s in full), default=None),
        "output_tokens": [len(o.token_ids) for o in outputs],
        "_finish_reasons": [o.finish_reason for o in outputs],
        "fill_ms_median": _median_ms([t for rows, t in recorder.fills if rows == batch]),
        "apply_host_ms_median": _median_ms([t for rows, t, _, _ in recorder.applies if rows == batch]),
        "apply_device_ms_median": _median_ms(device_apply),
        "_token_ids": [list(o.token_ids) for o in outputs],
        "_texts": [o.text for o in outputs],
    }


def compile_times(llm: Any, so_params: Any) -> dict[str, float]:
    """The engine core's manager compiling ``so_params``: tokenizer info (the backend's
    first use), a cold compile (submit to ready) and a second request's cached lookup."""
    from kvloom import SamplingParams
    from kvloom.request import Request

    manager = llm.llm_engine.engine_core.core.structured_output_manager
    start = time.perf_counter()
    manager.backend  # noqa: B018 -- builds the backend (xgrammar's TokenizerInfo) once
    result = {"tokenizer_info_s": time.perf_counter() - start}
    for key in ("cold_s", "cached_s"):
        request = Request(f"compile-{key}", [0], SamplingParams(structured_outputs=so_params))
        start = time.perf_counter()
        manager.grammar_init(request)
        while (ready := manager.grammar_ready(request)) is False:
            time.sleep(1e-4)
        result[key] = time.perf_counter() - start
        if ready is not True:
            raise RuntimeError(f"the benchmark's schema did not compile: {ready}")
        manager.free(request.request_id)
    return result


def run_mode(model_dir: Path, mode: str, prompts: list[list[int]], args: argparse.Namespace,
             device: torch.device) -> dict[str, Any]:  # fmt: skip
    from kvloom import LLM, SamplingParams, StructuredOutputsParams
    from kvloom.sampling_params import RequestOutputKind
    from kvloom.testing.json_schema import schema_errors

    start = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 8,
              max_num_seqs=args.batch, enforce_eager=args.enforce_eager, async_scheduling=(mode == "async"),
              gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=True,
              **({"kv_cache_memory": "256MiB"} if device.type == "cpu" else {}))  # fmt: skip
    init_s = time.perf_counter() - start
    recorder = StepRecorder(llm, device)
    try:
        so_params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        compiled = compile_times(llm, so_params)
        final = RequestOutputKind.FINAL_ONLY  # as LLM.generate: outputs built only at the end
        # Warm-up (first launches, the bitmask kernel, the allocator): short requests of each kind.
        for warm in (
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=final),
            SamplingParams(temperature=0, max_tokens=4, output_kind=final, structured_outputs=so_params),
        ):
            run_batch(recorder, prompts[:4], warm, "warm", 4)  # fmt: skip
        constrained = run_batch(recorder, prompts, SamplingParams(
            temperature=0, max_tokens=args.max_tokens, output_kind=final, structured_outputs=so_params),
            "so", args.batch)  # fmt: skip
        plain_len = max(1, round(statistics.mean(constrained["output_tokens"])))
        plain = run_batch(recorder, prompts, SamplingParams(temperature=0, max_tokens=plain_len, ignore_eos=True,
                                                                 output_kind=final), "plain", args.batch)  # fmt: skip
    finally:
        recorder.close()
        llm.llm_engine.shutdown()
    invalid, truncated = [], 0
    for i, (text, reason) in enumerate(zip(constrained["_texts"], constrained["_finish_reasons"])):
        if reason != "stop":  # cut by --max-tokens: a prefix, not a whole value
            truncated += 1
            continue
        try:
            errors = schema_errors(json.loads(text), SCHEMA)
        except json.JSONDecodeError as exc:
            errors = [f"not JSON: {exc}"]
        if errors:
            invalid.append({"request": i, "errors": errors[:3], "text": text[:200]})
    ratio = None
    if constrained["step_ms_median"] and plain["step_ms_median"]:
        ratio = constrained["step_ms_median"] / plain["step_ms_median"]
    result = {"mode": mode, "init_s": init_s, "compile": compiled, "constrained": constrained, "plain": plain,
              "plain_max_tokens": plain_len, "step_time_ratio": ratio,
              "meets_target": ratio is not None and ratio <= TARGET_RATIO, "valid_outputs": args.batch - truncated - len(invalid),
              "truncated_outputs": truncated, "invalid_outputs": invalid[:5], "example_output": constrained["_texts"][0][:400]}  # fmt: skip
    del llm, recorder
    torch._dynamo.reset()  # compiled code (with --torch-compile) keeps the engine's tensors alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def summarize(result: dict[str, Any]) -> None:
    """Cross-mode findings: identical greedy tokens, overlap under async scheduling."""
    runs = {r["mode"]: r for r in result["runs"]}
    if {"sync", "async"} <= set(runs):
        for kind in ("constrained", "plain"):
            a, b = runs["sync"][kind]["_token_ids"], runs["async"][kind]["_token_ids"]
            result[f"{kind}_tokens_identical_sync_async"] = a == b
            result[f"{kind}_requests_differing_sync_async"] = sum(x != y for x, y in zip(a, b))
    if "async" in runs:
        # Whether a step stays in flight between step() calls (async overlap) while the
        # whole batch decodes; the unconstrained run shows what overlap looks like.
        for kind in ("plain", "constrained"):
            in_flight = runs["async"][kind]["max_in_flight_between_full_steps"]
            result[f"async_{kind}_overlaps"] = None if in_flight is None else in_flight > 0
        overlaps = result["async_constrained_overlaps"]
        result["structured_requests_force_synchronous_steps"] = None if overlaps is None else not overlaps
    ratios = [r["step_time_ratio"] for r in result["runs"] if r["step_time_ratio"] is not None]
    result["worst_step_time_ratio"] = max(ratios) if ratios else None
    result["meets_target"] = bool(ratios) and max(ratios) <= TARGET_RATIO
    for run in result["runs"]:
        for kind in ("constrained", "plain"):
            for key in ("_token_ids", "_texts", "_finish_reasons"):
                run[kind].pop(key)


def print_table(result: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return f"{v:8.3f}" if v is not None else "       -"

    print(f"\n== structured output, {result['shape']} shape, batch {result['batch']}, {result['device_name']}")
    print(f"{'mode':>6} {'run':>12} {'steps@B':>7} {'step ms':>8} {'ratio':>6} {'fill ms':>8} {'apply host':>10} "
          f"{'apply dev':>9} {'tokens':>7} {'valid':>6}")  # fmt: skip
    for run in result["runs"]:
        for kind in ("plain", "constrained"):
            r = run[kind]
            ratio = f"{run['step_time_ratio']:6.3f}" if kind == "constrained" and run["step_time_ratio"] else "     -"
            valid = f"{run['valid_outputs']}/{result['batch']}" if kind == "constrained" else "-"
            print(f"{run['mode']:>6} {kind:>12} {r['full_batch_steps']:7d} {ms(r['step_ms_median'])} {ratio} "
                  f"{ms(r['fill_ms_median'])} {ms(r['apply_host_ms_median']):>10} {ms(r['apply_device_ms_median']):>9} "
                  f"{statistics.mean(r['output_tokens']):7.1f} {valid:>6}")  # fmt: skip
    for run in result["runs"]:
        c = run["compile"]
        print(f"{run['mode']:>6} compile: tokenizer info {1e3 * c['tokenizer_info_s']:.1f} ms, schema cold "
              f"{1e3 * c['cold_s']:.1f} ms, cached {1e3 * c['cached_s']:.3f} ms")  # fmt: skip
    for key in (
        "constrained_tokens_identical_sync_async",
        "plain_tokens_identical_sync_async",
        "async_plain_overlaps",
        "async_constrained_overlaps",
        "structured_requests_force_synchronous_steps",
        "worst_step_time_ratio",
        "meets_target",
    ):
        if key in result:
            print(f"{key}: {result[key]}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="Directory with the tokenizer files (e.g. .benchtok).")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--shape", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="Cap of the constrained requests (the schema ends them well before).",
    )
    parser.add_argument("--modes", default="sync,async", help="comma-separated: sync, async (async_scheduling)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="Per engine; the modes' engines run one after the other in this process.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"sync", "async"}:
        parser.error(f"--modes: {args.modes!r}; allowed: sync, async (comma-separated)")
    if args.batch < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        parser.error("--batch, --prompt-len and --max-tokens must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu with --shape tiny)")
    # The recorder wraps the scheduler and the model runner: the engine core runs here.
    os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"
    if device.type == "cpu":
        os.environ["KVLOOM_PLATFORM"] = "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "shape": args.shape, "batch": args.batch,
        "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({list(argv)})",
        "method": "median wall time of LLMEngine.step() over the steps that decode all --batch requests one token "
        "each (engine core in process); ratio = constrained / unconstrained median, per scheduling mode",
        "target_ratio": TARGET_RATIO, "schema": SCHEMA, "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tokenizer = model_dir_with_tokenizer(Path(tmp), Path(args.tokenizer), args.shape)
        result["vocab_size"] = len(tokenizer)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, len(tokenizer), (args.batch, args.prompt_len), generator=g).tolist()
        for mode in modes:
            run = run_mode(model_dir, mode, prompts, args, device)
            result["runs"].append(run)
            logger.info("%s: %s", mode, {k: v for k, v in run.items() if k not in ("constrained", "plain")})
    summarize(result)
    (out / "structured_output.json").write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
