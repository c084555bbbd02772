"""``kvloom backends``: which attention backend would run a configuration, and why.

``kvloom backends [options]`` prints the active platform, the priority table (every
candidate with valid/invalid, every reason, and the distribution that provides it),
the backend that would be selected and the block size it would use (the one given with
``--block-size``, else the selected backend's choice: e.g. 256 for FLASH_ATTN, whose
kernels take multiples of 256 only; with ``--block-size 16`` FLASH_ATTN is invalid and
its reason names the sizes it accepts).
``--json`` prints ``{"platform", "device_name", "selected", "block_size", "candidates":
[{"name", "priority", "valid", "reasons", "distribution", "version"}]}`` (``device_name``:
the platform's ``get_device_name()``, null where the platform is not available here).
Exit status: 0 when a backend is selected, 1 otherwise.

For an MLA model (``--model`` of a DeepSeek-V2/V3 checkpoint, or ``--use-mla``) there are
two selections, each with its own table: the decode backend (``--attention-backend``,
head size ``kv_lora_rank + qk_rope_head_dim``) and the prefill backend
(``--mla-prefill-backend``, head size ``qk_nope_head_dim + qk_rope_head_dim``); ``--json``
adds ``"prefill": {"selected", "candidates"}``. ``--use-mla`` without ``--model`` uses
DeepSeek-V2/V3's dims (latent 512 + 64, nope 128, v 128).

Without ``--model`` the configuration is ``--head-size`` (default 128, the head size of
most current LLMs) and ``--dtype`` (default: the platform's preferred dtype).
``--device-capability X.Y`` simulates a GPU generation (e.g. 10.0 for Blackwell) and
``--platform NAME`` shows any installed platform's table even where its device is
absent, so the CUDA priorities can be inspected on a laptop.

``kvloom backends test NAME`` runs the backend conformance suite against an installed
backend (``kvloom.testing.conformance``); exit status 0 when it passes.

``kvloom backends tune MODEL`` (a CUDA GPU) times every valid backend for the model's
attention on this device and caches the result; where such a tune exists for the
configuration (``--model`` gives the heads it is keyed by), the table lists the valid
backends it measured first, fastest first, with their measured step times, and says that
the order came from the tune (``--json``: ``"order": "tune"`` and each candidate's
``measured_ms``); the engine selects the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.attention.backend import AttentionSelectorConfig
    from kvloom.attention.selector import SelectionReport
    from kvloom.platforms.interface import Platform

#: Head size used when neither --model nor --head-size is given (Llama/Qwen/Mistral's).
DEFAULT_HEAD_SIZE = 128

_DTYPE_CHOICES = ("auto", "float32", "float", "float16", "half", "bfloat16")


def register_subparser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "backends",
        help="show the attention backends, their priority and validity for a configuration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="HF model directory or .gguf file to read head size and dtype from")
    parser.add_argument("--dtype", default="auto", choices=_DTYPE_CHOICES, help="model dtype (default: auto)")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="KV-cache dtype, e.g. auto, float16, fp8 (default: auto)"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: the backend's choice)"
    )
    parser.add_argument(
        "--head-size",
        type=int,
        default=None,
        help=f"attention head size (default: the model's, else {DEFAULT_HEAD_SIZE})",
    )
    parser.add_argument("--use-mla", action="store_true", help="select for multi-head latent attention (MLA)")
    parser.add_argument(
        "--device-capability",
        default=None,
        metavar="X.Y",
        help="simulate a CUDA compute capability (forms: 9.0, 90, sm90); default: the device's",
    )
    parser.add_argument(
        "--platform",
        default=None,
        metavar="NAME",
        help="show the table of this installed platform, even if its device is absent here "
        "(default: the active platform)",
    )
    parser.add_argument(
        "--attention-backend", default=None, metavar="NAME",
        help="check an explicit choice instead of priority order (MLA: the decode backend)",
    )
    parser.add_argument(
        "--mla-prefill-backend", default=None, metavar="NAME",
        help="MLA models: check an explicit prefill backend instead of priority order",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_backends)

    sub = parser.add_subparsers(dest="backends_command", metavar="{test,tune}")
    test = sub.add_parser(
        "test",
        help="run the backend conformance suite against an installed backend",
        description="Run kvloom's attention backend conformance suite against backend NAME "
        "(KV-cache writes, prefill, chunked prefill, decode, mixed batches, every declared "
        "dtype/head size/block size) against a float64 reference.",
    )
    test.add_argument("name", metavar="NAME", help="the backend's NAME, e.g. CPU_ATTN")
    test.add_argument("--device", choices=("cpu", "cuda"), default=None, help="device (default: the active platform's)")
    test.add_argument("--quick", action="store_true", help="a reduced set of cases")
    test.set_defaults(func=run_backend_test)
    from kvloom.entrypoints.cli import backends_tune

    backends_tune.register(sub, _DTYPE_CHOICES, build_selector_config)


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag}: {value} is not a positive integer (allowed: 1 and above)")


#: DeepSeek-V2/V3's MLA dims, for ``--use-mla`` without ``--model``.
DEFAULT_MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def build_selector_config(
    args: argparse.Namespace, platform: type["Platform"], mla_phase: str = "decode"
) -> "AttentionSelectorConfig":
    """The selection inputs from the flags (and the model's config with --model); for an
    MLA model those of ``mla_phase`` (``"decode"`` or ``"prefill"``)."""
    import dataclasses

    config = _base_selector_config(args, platform)
    if not config.use_mla:
        return config
    text = None
    if args.model:
        from kvloom.loader.model_source import load_hf_config, resolve_model_source

        hf_config = load_hf_config(resolve_model_source(args.model))
        text = getattr(hf_config, "text_config", None) or hf_config
    dims = {k: getattr(text, k, None) or v for k, v in DEFAULT_MLA_DIMS.items()}
    heads = config.num_heads
    if mla_phase == "decode":
        return dataclasses.replace(
            config, head_size=args.head_size or dims["kv_lora_rank"] + dims["qk_rope_head_dim"], mla_phase="decode",
            num_kv_heads=1 if heads is not None else None,
        )  # fmt: skip
    return dataclasses.replace(
        config, head_size=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], block_size=None,
        mla_phase="prefill", v_head_dim=dims["v_head_dim"], num_kv_heads=heads,
    )  # fmt: skip


def _base_selector_config(args: argparse.Namespace, platform: type["Platform"]) -> "AttentionSelectorConfig":
    from kvloom.attention.backend import AttentionSelectorConfig
    from kvloom.engine.config_builder import resolve_dtype
    from kvloom.platforms.interface import DeviceCapability

    _positive(args.block_size, "--block-size")
    _positive(args.head_size, "--head-size")
    hf_config = None
    head_size = num_heads = num_kv_heads = None
    if args.model:
        from kvloom.loader.model_source import load_hf_config, resolve_model_source

        hf_config = load_hf_config(resolve_model_source(args.model))
        text = getattr(hf_config, "text_config", None) or hf_config
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        use_mla = args.use_mla or getattr(text, "kv_lora_rank", None) is not None
    else:
        use_mla = args.use_mla
    if args.head_size is not None:
        head_size = args.head_size
    capability = (
        DeviceCapability.parse(args.device_capability)
        if args.device_capability
        else platform.get_device_capability() if platform.is_available() else None
    )
    return AttentionSelectorConfig(
        head_size=head_size or DEFAULT_HEAD_SIZE,
        dtype=resolve_dtype(args.dtype, hf_config, platform.supported_dtypes, platform.name),
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        use_mla=use_mla,
        device_type=platform.device_type,
        device_capability=capability,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )


def _print_table(
    report: "SelectionReport", platform_label: str, device_name: str | None, title: str = "Attention backends"
) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvloom.attention.backend import dtype_name

    config = report.config
    # Piped output gets 120 columns rather than rich's 80, so reasons stay readable.
    console = Console(width=None if sys.stdout.isatty() else 120)
    capability = config.device_capability if config.device_capability is not None else "n/a"
    device = config.device_type
    if device_name and device_name != device:
        device += f" ({device_name})"
    console.print(
        f"Platform: {platform_label}, device {device}, capability {capability}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        f"Configuration: head_size={config.head_size}, dtype={dtype_name(config.dtype)}, "
        f"kv_cache_dtype={config.kv_cache_dtype}, "
        f"block_size={config.block_size if config.block_size is not None else 'auto'}, use_mla={config.use_mla}"
        + (f", mla_phase={config.mla_phase}" if config.mla_phase else "")
        + (f", v_head_size={config.v_head_dim}" if config.v_head_dim else "")
        + (f", requested={report.requested}" if report.requested else ""),
        soft_wrap=True,
        highlight=False,
    )
    table = Table(title=f"{title} in priority order", title_justify="left")
    measured = report.tune is not None
    for column in ("#", "Backend", "Status", "Distribution", "Version", *(("Measured ms",) if measured else ())):
        table.add_column(column, no_wrap=True)
    table.add_column("Reasons", overflow="fold")
    colors = {"valid": "green", "invalid": "red", "excluded": "yellow", "not installed": "yellow"}
    for c in report.candidates:
        status = f"[{colors[c.status]}]{c.status}[/]"
        if c.name == report.selected:
            status += " [bold](selected)[/]"
        time = (f"{c.measured_ms:.3f}" if c.measured_ms is not None else "not measured",) if measured else ()
        table.add_row(str(c.priority), c.name, status, c.distribution or "-", c.version or "-", *time,
                      "\n".join(c.reasons) or "-")  # fmt: skip
    console.print(table)
    if report.tune is not None:
        tune = report.tune
        console.print(f"Order: measured by `kvloom backends tune` ({tune.created}, {tune.num_layers} layers of "
                      f"{tune.model or 'the model'}): valid backends fastest first, then the platform's order; "
                      "ms = one step of every layer's attention over its decode and mixed cases",
                      soft_wrap=True, highlight=False)  # fmt: skip
    else:
        console.print("Order: the platform's (no `kvloom backends tune` result for this device and configuration)",
                      soft_wrap=True, highlight=False)  # fmt: skip
    if report.selected is not None and config.mla_phase == "prefill":
        # The prefill phase never reads the paged cache: no block size of its own.
        console.print(f"Selected: [bold]{report.selected}[/]")
    elif report.selected is not None:
        console.print(f"Selected: [bold]{report.selected}[/] (block size {report.block_size})")
        if config.block_size is None:
            console.print(
                f"Block size {report.block_size} chosen by {report.selected}; set --block-size to override.",
                soft_wrap=True,
                highlight=False,
            )
    else:
        console.print("Selected: [bold red]none[/]")


def run_backends(args: argparse.Namespace) -> int:
    from kvloom import plugins
    from kvloom.attention import selector

    if args.platform:
        platform = plugins.get_platform_by_name(args.platform)
    else:
        platform = plugins.current_platform()
    entry = plugins.platforms()[platform.name]
    # The device's name where it is here (--platform may show an absent one's table).
    device_name = platform.get_device_name() if platform.is_available() else None
    config = build_selector_config(args, platform)
    report = selector.report_attention_backends(platform, config, requested=args.attention_backend)
    prefill = None
    if config.use_mla:
        prefill_config = build_selector_config(args, platform, "prefill")
        prefill = selector.report_attention_backends(platform, prefill_config, requested=args.mla_prefill_backend)
    elif args.mla_prefill_backend is not None:
        print("kvloom: error: --mla-prefill-backend: the configuration is not MLA (use --use-mla or an MLA --model)",
              file=sys.stderr)  # fmt: skip
        return 2
    label = f"{platform.name} ({entry.distribution} {entry.version})"
    if args.json:
        data = report.to_json()
        out = {"platform": data.pop("platform"), "device_name": device_name, **data}
        if prefill is not None:
            prefill_data = prefill.to_json()
            out["prefill"] = {"selected": prefill_data["selected"], "candidates": prefill_data["candidates"]}
        print(json.dumps(out, indent=2))
    elif prefill is None:
        _print_table(report, label, device_name)
    else:
        _print_table(report, label, device_name, "MLA decode backends (--attention-backend)")
        print()
        _print_table(prefill, label, device_name, "MLA prefill backends (--mla-prefill-backend)")
    failed = [r.error for r in (report, prefill) if r is not None and r.error is not None]
    for error in failed:
        print(f"kvloom: error: {error}", file=sys.stderr)
    return 1 if failed else 0


def run_backend_test(args: argparse.Namespace) -> int:
    from kvloom import plugins
    from kvloom.testing.conformance import run_conformance

    device = args.device or plugins.current_platform().device_type
    kwargs: dict[str, Any] = {"device": device}
    if args.quick:
        kwargs["quick"] = True
    report = run_conformance(args.name, **kwargs)
    print(report.format())
    return 0 if report.passed else 1
