"""``kvloom backends tune MODEL``: time every valid attention backend on this GPU for the
model's attention shape, and cache the result so that the next engine start with that
configuration selects the fastest (``kvloom.attention.tuning``).

It times, per backend, decode steps at batch 1, 16, 64 and 256 over 1,024 cached tokens
(in a full CUDA graph where the backend supports one) and a mixed step of 64 decodes with
a 512-token prefill chunk, each over all the model's layers, with the builder's per-step
host work included; prints the times and writes
``$KVLOOM_CACHE_DIR/backend_tune/<key>.json``. The key is the device's name and compute
capability, the head size, the query and KV heads, the dtype, the KV-cache dtype, the
block size (``--block-size``; unset: each backend at its preferred size, as the engine
then runs it) and kvloom's version: a tune holds only where all of them match. An engine
started with ``--attention-backend`` keeps that backend whatever the tune says.

It needs a CUDA GPU: on another platform it exits with status 2 and says so. MLA models
are not tuned yet (their decode and prefill backends keep the platform's order).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.attention.backend import AttentionSelectorConfig
    from kvloom.attention.tuning import BackendTune, StepTimer
    from kvloom.platforms.interface import Platform


#: ``build_selector_config(args, platform)`` of ``kvloom backends`` (handed in: that
#: module registers this one).
ConfigBuilder = Callable[[argparse.Namespace, "type[Platform]"], "AttentionSelectorConfig"]


def register(subparsers: Any, dtype_choices: tuple[str, ...], build_config: ConfigBuilder) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="time every valid attention backend on this GPU for a model and cache the fastest order",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", metavar="MODEL", help="HF model directory or .gguf file (its attention shape is timed)")
    tune.add_argument("--dtype", default="auto", choices=dtype_choices, help="model dtype (default: auto)")
    tune.add_argument("--kv-cache-dtype", default="auto", help="KV-cache dtype (default: auto, the model dtype)")
    tune.add_argument("--block-size", type=int, default=None,
                      help="tokens per KV block (default: each backend's preferred size, as the engine picks)")  # fmt: skip
    tune.add_argument("--iters", type=int, default=20, help="timed steps per case (default: 20)")
    tune.add_argument("--json", action="store_true", help="print the tune as JSON")
    tune.set_defaults(func=functools.partial(run_tune_command, build_config=build_config), head_size=None,
                      use_mla=False, device_capability=None)  # fmt: skip


def run_tune_command(args: argparse.Namespace, build_config: ConfigBuilder) -> int:
    import torch

    from kvloom import plugins

    plugins.load_plugins()
    platform = plugins.current_platform()
    if platform.device_type != "cuda" or not torch.cuda.is_available():
        print(f"kvloom: error: kvloom backends tune times attention kernels on a CUDA GPU; the active platform is "
              f"{platform.name}, with no CUDA device here (nothing to tune: the backend order stays the "
              "platform's)", file=sys.stderr)  # fmt: skip
        return 2
    if args.iters < 1:
        print(f"kvloom: error: --iters: {args.iters} (allowed: 1 and above)", file=sys.stderr)
        return 2
    from kvloom.attention.tune_timing import step_time

    device = torch.device("cuda")

    def on_the_gpu(backend: Any, config: Any, case: Any, num_layers: int) -> float:
        return step_time(backend, config, case, num_layers, device, iters=args.iters)

    return tune_and_report(args, platform, build_config(args, platform), on_the_gpu)


def tune_and_report(
    args: argparse.Namespace, platform: type[Platform], config: AttentionSelectorConfig, time_step: StepTimer
) -> int:
    """Time the valid backends for ``config`` (``args.model``'s attention) on ``platform``
    with ``time_step``, cache and print the result (the command's work once the device is
    known to be there)."""
    from kvloom.attention import selector
    from kvloom.attention.tuning import TuneKey, run_tune, save_tune
    from kvloom.loader.model_source import load_hf_config, resolve_model_source

    key = TuneKey.of(platform, config)
    if key is None:
        print("kvloom: error: MODEL uses multi-head latent attention (MLA), which kvloom backends tune does not "
              "time yet; its backends keep the platform's order", file=sys.stderr)  # fmt: skip
        return 2
    report = selector.report_attention_backends(platform, config, tune=None)
    backends = [selector.get_attention_backend(c.name) for c in report.candidates if c.valid]
    if not backends:
        print(f"kvloom: error: no valid attention backend to time: {report.error}", file=sys.stderr)
        return 1
    hf_config = load_hf_config(resolve_model_source(args.model))
    num_layers = int(getattr(getattr(hf_config, "text_config", None) or hf_config, "num_hidden_layers"))
    tune = run_tune(key, config, backends, time_step, num_layers, model=args.model)
    path = save_tune(tune)
    if args.json:
        print(json.dumps({"path": str(path), **tune.to_json()}, indent=2))
    else:
        print(format_tune(tune))
        print(f"Saved to {path}")
    fastest = tune.fastest_first()
    if not fastest:
        print("kvloom: error: no backend could be timed (see the errors above)", file=sys.stderr)
        return 1
    return 0


def format_tune(tune: BackendTune) -> str:
    """The tune as a text table: one row per backend, one column per step, the total last."""
    key = tune.key
    cases = list(dict.fromkeys(case for b in tune.backends for case in b.times_ms))
    lines = [
        f"Device {key.device_name} (capability {key.capability}); head_size={key.head_size}, heads={key.num_heads}, "
        f"kv_heads={key.num_kv_heads}, dtype={key.dtype}, kv_cache_dtype={key.kv_cache_dtype}, "
        f"block_size={key.block_size if key.block_size is not None else 'auto'}; {tune.num_layers} layers; "
        "ms per step (builder + every layer's attention)",
    ]
    header = f"{'backend':<16}{'block':>6}" + "".join(f"{c:>14}" for c in cases) + f"{'total':>12}"
    lines.append(header)
    order = {name: i for i, name in enumerate(tune.fastest_first())}
    for b in sorted(tune.backends, key=lambda b: order.get(b.name, len(order))):
        if b.error is not None:
            lines.append(f"{b.name:<16}{b.block_size:>6}  failed: {b.error}")
            continue
        total = b.total_ms
        cells = "".join(f"{b.times_ms[c]:>14.3f}" if c in b.times_ms else f"{'-':>14}" for c in cases)
        lines.append(f"{b.name:<16}{b.block_size:>6}{cells}{total:>12.3f}" if total is not None else b.name)
    fastest = tune.fastest_first()
    if fastest:
        lines.append(f"Fastest: {fastest[0]}; an engine with this configuration on this device now selects it "
                     "(unless --attention-backend names another)")  # fmt: skip
    return "\n".join(lines)
