#!/usr/bin/env python3
"""The peers side by side as markdown, lease by lease: reads every result JSON of ``tests/gpu/run.sh peers``
(``ENGINE_WORKLOAD.json`` for engines vllm, sglang and kvloom and workloads offline, decode and serving, kvloom
variants ``kvloom-LABEL_WORKLOAD.json``, ``kvloom_decode_steps.json``) from one or more directories and writes one
page, ``docs/benchmarks/peers_h200.md``; a directory's ``notes.md`` (hand-written: where the time goes, what did not
run) is shown under its name.

A lease is one machine from its start to its return (``engines.lease_id``: the host and its boot id; a result without
one counts as a lease of its own directory). Numbers are grouped by lease and every ratio divides numbers of the same
lease only: kvloom / a peer in throughput (above 1: kvloom faster; for step times, the peer's step / kvloom's), each
peer beside the kvloom run of its lease. A missing result is reported as not measured, a failed run as its error.

    python benchmarks/peers/report.py DIR [DIR...] [--out docs/benchmarks/peers_h200.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "sglang", "kvloom")
PEERS = ("vllm", "sglang")
WORKLOADS = ("offline", "decode", "serving")
CLIENTS = ("vllm", "kvloom")

log = logging.getLogger("peers.report")

#: lease -> {"vllm_offline": result, "kvloom_decode_steps": ..., "kvloom-LABEL_serving": ...}
Leases = dict[str, dict[str, dict[str, Any]]]


def load(dirs: list[Path]) -> Leases:
    leases: Leases = {}
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(f"results directory {d} does not exist")
        for path in sorted(d.glob("*.json")):
            name = path.stem
            known = name == "kvloom_decode_steps" or any(
                name == f"{e}_{w}" or (name.startswith("kvloom-") and name.endswith(f"_{w}"))
                for e in ENGINES for w in WORKLOADS)  # fmt: skip
            if not known:
                continue
            data = json.loads(path.read_text())
            lease = data.get("lease")
            if lease is None and name == "kvloom_decode_steps" and (d / "kvloom_decode.json").exists():
                # the engine-step cross-check (bench_decode_roofline.py) runs right after kvloom's decode
                lease = json.loads((d / "kvloom_decode.json").read_text()).get("lease")
            leases.setdefault(lease or f"{d.name} (no lease recorded)", {})[name] = data
    return leases


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return format(x, fmt) if x is not None else "–"


def _ratio(kvloom: float | None, peer: float | None) -> str:
    return f"**{kvloom / peer:.2f}x**" if kvloom and peer else "–"


def _flags(settings: Any) -> str:
    if isinstance(settings, dict):
        return ", ".join(f"`{k}={v}`" for k, v in settings.items())
    return f"`{' '.join(settings)}`" if settings else "(none)"


def _label(leases: Leases) -> dict[str, str]:
    return {lease: f"L{i}" for i, lease in enumerate(sorted(leases), start=1)}


def _engines_of(results: dict[str, Any], workload: str) -> list[str]:
    names = [e for e in ENGINES if f"{e}_{workload}" in results]
    names += sorted(k.removesuffix(f"_{workload}") for k in results if k.startswith("kvloom-") and
                    k.endswith(f"_{workload}"))  # fmt: skip
    return names


def _per_lease(leases: Leases, workload: str) -> Iterator[tuple[str, dict[str, Any], dict[str, dict[str, Any]]]]:
    """(lease, its results, {engine: its result of ``workload``}) for every lease, in order."""
    for lease, results in sorted(leases.items()):
        yield lease, results, {e: results[f"{e}_{workload}"] for e in _engines_of(results, workload)}


def offline_section(leases: Leases, labels: dict[str, str]) -> list[str]:
    lines = ["## Offline: nano-vllm's workload", "", "| lease | engine | version | start-up s | output tok/s, each run "
             "| best | kvloom / this engine (same lease) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    found = False
    for lease, _, runs in _per_lease(leases, "offline"):
        best = {e: max((x["output_tok_s"] for x in r.get("runs", [])), default=None) for e, r in runs.items()}
        for e, r in runs.items():
            found = True
            each = ", ".join(_num(x["output_tok_s"]) for x in r.get("runs", [])) or "no run"
            ratio = _ratio(best.get("kvloom"), best[e]) if e in PEERS else "–"
            lines.append(f"| {labels[lease]} | {e} | {r['version']} | {_num(r.get('init_s'))} | {each} | "
                         f"{_num(best[e])} | {ratio} |")  # fmt: skip
    if not found:
        return ["## Offline: nano-vllm's workload", "", "Not measured.", ""]
    spec = next(r["spec"] for res in leases.values() for k, r in res.items() if k.endswith("_offline"))
    lines += ["", f"{spec['model']}, {spec['num_seqs']} sequences, {spec['prompt_tokens']:,} prompt tokens, "
              f"{spec['output_tokens']:,} output tokens, temperature {spec['temperature']}, EOS ignored; the same "
              "prompts for every engine, each timed run after a warm-up and a prefix-cache reset.", ""]  # fmt: skip
    return lines


def decode_section(leases: Leases, labels: dict[str, str]) -> list[str]:
    lines = ["## Decode: Llama-3-8B shape", "", "| lease | batch | engine | step ms | kvloom / this engine (tok/s, "
             "same lease) | kvloom engine-step ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    found = False
    for lease, results, decodes in _per_lease(leases, "decode"):
        steps = {row["batch"]: row["mean_s"] for row in results.get("kvloom_decode_steps", {}).get("rows", [])}
        by = {e: {row["batch"]: row["step_s"] for row in r.get("rows", [])} for e, r in decodes.items()}
        for batch in sorted({b for rows in by.values() for b in rows}):
            for e, rows in by.items():
                found = True
                step = rows.get(batch)
                ratio = _ratio(by.get(e, {}).get(batch), by.get("kvloom", {}).get(batch)) if e in PEERS else "–"
                cross = _num(steps.get(batch) and 1e3 * steps[batch], ".2f") if e == "kvloom" else ""
                lines.append(f"| {labels[lease]} | {batch} | {e} | {_num(step and 1e3 * step, '.2f')} | {ratio} | "
                             f"{cross} |")  # fmt: skip
    if not found:
        return ["## Decode: Llama-3-8B shape", "", "Not measured.", ""]
    return lines + ["", "Step = (T(max_tokens=long) - T(max_tokens=short)) / (long - short), T the median of "
                    "`generate` calls of fresh prompts (benchmarks/peers/bench_decode.py, the same code on every "
                    "engine); the last column is kvloom's own engine-step timing (bench_decode_roofline.py).", ""]


def _median(runs: list[dict[str, Any]], key: str, stat: str | None = None) -> float | None:
    values = [r[key][stat] if stat else r[key] for r in runs if "error" not in r and r.get(key) is not None]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def serving_section(leases: Leases, labels: dict[str, str]) -> list[str]:
    lines = ["## Serving: each engine's OpenAI server, vLLM's client and kvloom's", "",
             ("| lease | concurrency | prompts | engine | client | runs (failed) | output tok/s | TTFT p50 ms | TPOT p50 "
              "ms | ITL p50 ms | ITL p99 ms | prefix-cache hits | kvloom / this engine (same lease, same client) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    found = False
    for lease, _, servers in _per_lease(leases, "serving"):
        keys = sorted({k for r in servers.values() for k in r.get("runs", {})}, key=lambda k: (k != "inf", k.zfill(8)))
        for key in keys:
            for client in CLIENTS:
                tput = {e: _median(r["runs"].get(key, {}).get(client, []), "output_throughput")
                        for e, r in servers.items()}  # fmt: skip
                for e, r in servers.items():
                    slot = r["runs"].get(key, {})
                    runs = slot.get(client)
                    if not runs:
                        continue
                    found = True
                    failed = sum("error" in x for x in runs)
                    errors = "; ".join(x["error"][:80] for x in runs if "error" in x)
                    hit = _median([x for x in runs if (x.get("prefix_cache") or {}).get("hit_rate") is not None],
                                  "prefix_cache", "hit_rate")  # fmt: skip
                    ratio = _ratio(tput.get("kvloom"), tput[e]) if e in PEERS else "–"
                    lines.append(
                        f"| {labels[lease]} | {key} | {slot.get('num_prompts', '–')} | {e} | {client} | {len(runs)} "
                        f"({failed}{': ' + repr(errors) if errors else ''}) | {_num(tput[e])} | "
                        f"{_num(_median(runs, 'ttft_ms', 'median'), '.1f')} | "
                        f"{_num(_median(runs, 'tpot_ms', 'median'), '.2f')} | "
                        f"{_num(_median(runs, 'itl_ms', 'median'), '.2f')} | {_num(_median(runs, 'itl_ms', 'p99'), '.1f')}"
                        f" | {_num(hit and 100 * hit, '.1f') + '%' if hit is not None else 'n/a'} | {ratio} |"
                    )  # fmt: skip
    if not found:
        return ["## Serving: each engine's OpenAI server, vLLM's client and kvloom's", "", "Not measured.", ""]
    lines += ["", "Each number is the median of the run's repeats (interleaved between the clients); every run sends "
              "fresh random-token prompts (no shared prefix; its own seed), EOS ignored, streamed.", ""]  # fmt: skip
    return lines


def startup_section(leases: Leases, labels: dict[str, str]) -> list[str]:
    lines = ["## Start-up: server start to healthy", "", "| lease | engine | cold s | warm s (compile cache kept) | "
             "kvloom / this engine (cold, warm; lower is better, same lease) |", "|---|---|---|---|---|"]  # fmt: skip
    found = False
    for lease, _, servers in _per_lease(leases, "serving"):
        k = servers.get("kvloom", {})
        for e, r in servers.items():
            if r.get("startup_s") is None:
                continue
            found = True
            ratios = "–"
            if e in PEERS and k.get("startup_s"):
                warm = (f"{k['startup_warm_s'] / r['startup_warm_s']:.2f}x" if k.get("startup_warm_s") and
                        r.get("startup_warm_s") else "–")  # fmt: skip
                ratios = f"{k['startup_s'] / r['startup_s']:.2f}x, {warm}"
            lines.append(f"| {labels[lease]} | {e} | {r['startup_s']:.0f} | {_num(r.get('startup_warm_s'))} | "
                         f"{ratios} |")  # fmt: skip
    return lines + [""] if found else []


def leases_section(leases: Leases, labels: dict[str, str]) -> list[str]:
    lines = ["## Leases and commands", ""]
    for lease, results in sorted(leases.items()):
        dates = sorted(r["date"] for r in results.values() if "date" in r)
        gpus = sorted({f"{r['gpu']}, torch {r['torch']}" for r in results.values() if "gpu" in r})
        lines.append(f"- **{labels[lease]}** = lease `{lease}`: {'; '.join(gpus) or 'machine unknown'}, "
                     f"{dates[0] if dates else '?'} to {dates[-1] if dates else '?'}")  # fmt: skip
        for name, r in sorted(results.items()):
            if "engine" not in r:
                lines.append(f"  - {name}: `{r.get('command', '?')}`")
                continue
            server = f"; server `{r['server_command']}`" if "server_command" in r else ""
            lines.append(f"  - {name}: {r['engine']} {r['version']}, flags {_flags(r.get('settings'))}; "
                         f"`{r['command']}`{server}")  # fmt: skip
            if "error" in r:
                lines.append(f"    - FAILED: `{r['error'][:300]}`")
    return lines + [""]


def notes_section(notes: dict[Path, str]) -> list[str]:
    """The hand-written ``notes.md`` of each results directory (what the tables cannot say: where an engine's time
    goes, what was not run), under a heading naming the directory."""
    lines: list[str] = []
    for d, text in notes.items():
        lines += [f"## Notes on `{d.name}`", "", text.strip(), ""]
    return lines


def render(leases: Leases, notes: dict[Path, str] | None = None) -> str:
    if not leases:
        raise SystemExit("no peer results found (expected ENGINE_WORKLOAD.json files from tests/gpu/run.sh peers)")
    labels = _label(leases)
    versions = sorted({f"{r['engine']} {r['version']}" for res in leases.values() for r in res.values() if "engine" in r})
    lines = ["# kvloom and its peers side by side on the H200", "",
             f"Engines: {', '.join(versions)}; {len(leases)} lease(s). Written by `python benchmarks/peers/report.py` "
             "from the JSON files of `bash tests/gpu/run.sh peers`. Every engine runs at its own defaults (kvloom's "
             "on CUDA: async scheduling and its measured backend order, with an empty `KVLOOM_CACHE_DIR`: no tune); "
             "each peer beside a kvloom run in the same lease, and a ratio only ever divides numbers of one lease "
             "(the lease column; the leases are listed at the end).", ""]  # fmt: skip
    lines += offline_section(leases, labels) + serving_section(leases, labels) + decode_section(leases, labels)
    lines += startup_section(leases, labels) + notes_section(notes or {}) + leases_section(leases, labels)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="Directories with the peers' JSON files.")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[2] / "docs/benchmarks/peers_h200.md")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    notes = {d: (d / "notes.md").read_text() for d in args.dirs if (d / "notes.md").is_file()}
    args.out.write_text(render(load(args.dirs), notes))
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
