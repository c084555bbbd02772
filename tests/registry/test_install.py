"""Acceptance: plugin distributions, installed with pip, seen by `kvloom`: the example packages
under plugins/examples/ (the backend and platform of docs/plugins.md) and the test fixtures
under tests/plugins/ (broken plugins, API 2.0, duplicate names, ...).

Each distribution is pip-installed once per session into its own ``--target`` directory
and made visible to a subprocess through PYTHONPATH, so the test environment itself is
never modified. Most runs pin ``KVLOOM_PLUGINS`` so that other plugins installed in the
environment (first-party backends, ...) cannot change the outcome.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvloom.plugins import PLUGIN_API_VERSION

from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.plugin_server import REPO, install_distribution, plugin_env

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
EXAMPLES = Path(__file__).resolve().parents[2] / "plugins" / "examples"
#: Example packages by the names the tests use (anything else is a tests/plugins fixture).
EXAMPLE_SOURCES = {
    "example_backend": EXAMPLES / "attention_backend",
    "example_platform": EXAMPLES / "platform",
    "example_io_processor": EXAMPLES / "io_processor",
    "example_stat_logger": EXAMPLES / "stat_logger",
    "example_lora_resolver": EXAMPLES / "lora_resolver",
}
#: Makes the example platform available (it is not, by default).
PLATFORM_ON = {"KVLOOM_EXAMPLE_PLATFORM": "1"}
CLI = [sys.executable, "-m", "kvloom.entrypoints.cli.main"]

Install = Callable[[str], Path]


@pytest.fixture(scope="session")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    """pip-installs an example package or tests/plugins/NAME into its own target
    directory (once per session)."""
    sites: dict[str, Path] = {}

    def _install(name: str) -> Path:
        if name not in sites:
            # Build from a copy: an in-tree build would leave build/ and *.egg-info behind.
            src = tmp_path_factory.mktemp(f"src-{name}") / name
            source = EXAMPLE_SOURCES.get(name, PLUGINS / name)
            shutil.copytree(source, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            target = tmp_path_factory.mktemp(f"site-{name}")
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                   "--no-index", "--target", str(target), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"pip install {name} failed:\n{done.stdout}\n{done.stderr}"
            sites[name] = target
        return sites[name]

    return _install


def run(
    install: Install, cmd: Sequence[str], plugins: Sequence[str] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    paths = [str(install(p)) for p in plugins]
    if environment.get("PYTHONPATH"):
        paths.append(environment["PYTHONPATH"])
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    environment["KVLOOM_LOGGING_LEVEL"] = "WARNING"
    environment.update(env)
    return subprocess.run(list(cmd), env=environment, capture_output=True, text=True, timeout=300)


def backends_json(install: Install, *args: str, plugins: Sequence[str] = (), expect_rc: int = 0, **env: str) -> dict[str, Any]:
    done = run(install, [*CLI, "backends", "--json", *args], plugins, **env)
    assert done.returncode == expect_rc, done.stderr
    return json.loads(done.stdout)


def candidate(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in report["candidates"] if c["name"] == name)


# ---------------------------------------------------------------------- out-of-tree backend


def test_oot_backend_appears_in_backends_json(install: Install) -> None:
    report = backends_json(install, plugins=["example_backend"], KVLOOM_PLATFORM="cpu")
    assert report["platform"] == "cpu"
    oot = candidate(report, "EXAMPLE_ATTN")
    # measured_ms is null: no `kvloom backends tune` result orders this device's candidates.
    assert oot == {"name": "EXAMPLE_ATTN", "priority": oot["priority"], "valid": True, "reasons": [],
                   "distribution": "kvloom-example-attention-backend", "version": "0.1.0", "measured_ms": None}
    # The CPU platform does not list it: it ranks after the platform's own list.
    assert [c["name"] for c in report["candidates"][:2]] == ["CPU_ATTN", "FLEX_ATTENTION"]
    assert oot["priority"] > 2


def test_oot_backend_is_validated(install: Install) -> None:
    pinned = {"KVLOOM_PLUGINS": "cpu,EXAMPLE_ATTN"}
    report = backends_json(install, "--head-size", "96", "--block-size", "12", plugins=["example_backend"],
                           expect_rc=1, **pinned)  # fmt: skip
    assert report["selected"] is None
    assert candidate(report, "EXAMPLE_ATTN")["reasons"] == [
        "block size 12 not supported (supports multiples of 8)",
        "head size 96 not supported (supports 16, 32, 64, 128)",
    ]


def test_oot_backend_chosen_by_priority_when_cpu_backends_are_filtered_out(install: Install) -> None:
    report = backends_json(install, plugins=["example_backend"], KVLOOM_PLUGINS="cpu,EXAMPLE_ATTN")
    assert (report["selected"], report["block_size"]) == ("EXAMPLE_ATTN", 16)
    assert [c["name"] for c in report["candidates"] if c["valid"]] == ["EXAMPLE_ATTN"]


def test_oot_backend_selected_by_name_and_never_falls_back(install: Install) -> None:
    report = backends_json(install, "--attention-backend", "EXAMPLE_ATTN", "--block-size", "32",
                           plugins=["example_backend"], KVLOOM_PLATFORM="cpu")
    assert (report["selected"], report["block_size"]) == ("EXAMPLE_ATTN", 32)
    done = run(install, [*CLI, "backends", "--json", "--attention-backend", "EXAMPLE_ATTN", "--head-size", "96"],
               ["example_backend"], KVLOOM_PLATFORM="cpu")
    assert done.returncode == 1 and json.loads(done.stdout)["selected"] is None
    assert ("Selected backend EXAMPLE_ATTN is not valid for this configuration. "
            "Reasons: ['head size 96 not supported (supports 16, 32, 64, 128)']") in done.stderr
    unknown = run(install, [*CLI, "backends", "--attention-backend", "EXAMPLE"], ["example_backend"],
                  KVLOOM_PLATFORM="cpu")  # fmt: skip
    assert unknown.returncode == 1
    assert "Unknown attention backend 'EXAMPLE'. Valid names: " in unknown.stderr and "EXAMPLE_ATTN" in unknown.stderr


# ---------------------------------------------------------------------- out-of-tree platform


def test_oot_platform_wins_and_its_priority_picks_the_oot_backend(install: Install) -> None:
    done = run(install, [*CLI, "backends"], ["example_backend", "example_platform"], **PLATFORM_ON)
    assert done.returncode == 0, done.stderr
    assert "Platform: example_cpu (kvloom-example-platform 0.1.0), device cpu (example device (host CPU))" in done.stdout
    assert "Selected: EXAMPLE_ATTN (block size 16)" in done.stdout
    report = backends_json(install, plugins=["example_backend", "example_platform"], **PLATFORM_ON)
    assert (report["platform"], report["device_name"]) == ("example_cpu", "example device (host CPU)")
    assert report["candidates"][0] == {"name": "EXAMPLE_ATTN", "priority": 1, "valid": True, "reasons": [],
                                       "distribution": "kvloom-example-attention-backend", "version": "0.1.0",
                                       "measured_ms": None}
    assert report["selected"] == "EXAMPLE_ATTN"


def test_oot_platform_reports_its_missing_backend(install: Install) -> None:
    report = backends_json(install, plugins=["example_platform"], expect_rc=1, KVLOOM_PLUGINS="example_cpu",
                           **PLATFORM_ON)  # fmt: skip
    assert report["platform"] == "example_cpu"
    assert report["candidates"][0]["reasons"] == ["not installed (pip install kvloom-example-attention-backend)"]


def test_unavailable_or_overridden_oot_platform_gives_way_to_cpu(install: Install) -> None:
    plugins = ["example_backend", "example_platform"]
    assert backends_json(install, plugins=plugins)["platform"] == "cpu"  # KVLOOM_EXAMPLE_PLATFORM unset
    assert backends_json(install, plugins=plugins, KVLOOM_PLATFORM="cpu", **PLATFORM_ON)["platform"] == "cpu"
    forced = run(install, [*CLI, "backends"], plugins, KVLOOM_PLATFORM="example_cpu")
    assert forced.returncode == 1
    assert ("KVLOOM_PLATFORM=example_cpu: platform example_cpu (kvloom-example-platform 0.1.0) is installed, but "
            "its is_available() returned False: KVLOOM_EXAMPLE_PLATFORM is not set to 1.") in forced.stderr


def test_unset_cpu_threads_platform_says_why_it_is_unavailable(tmp_path: Path) -> None:
    """plugins/cpu_threads_platform is a CPU platform: unavailable, it names its variable
    (there is a CPU device, so "no cpu device" would be wrong)."""
    site = install_distribution(REPO / "plugins" / "cpu_threads_platform", tmp_path)
    done = subprocess.run([*CLI, "backends"], env=plugin_env([site], KVLOOM_PLATFORM="cpu_threads"),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1
    assert ("platform cpu_threads (kvloom-platform-cpu-threads 0.1.0) is installed, but its is_available() "
            "returned False: KVLOOM_CPU_THREADS_PLATFORM is not set.") in done.stderr


def test_generate_logs_the_platform_device_name(install: Install) -> None:
    done = run(install, [*CLI, "generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hello", "--raw",
                         "--max-tokens", "1", "--dtype", "float32", "--kv-cache-memory", "32MiB"],
               ["example_backend", "example_platform"], KVLOOM_LOGGING_LEVEL="INFO", **PLATFORM_ON)
    assert done.returncode == 0, done.stderr
    assert "platform=example_cpu device=example device (host CPU) backend=" in done.stderr


# ---------------------------------------------------------------------- loading policy


def test_broken_plugin_is_a_loud_error_with_traceback(install: Install) -> None:
    done = run(install, [*CLI, "backends", "--json"], ["broken_plugin", "example_backend"])
    assert done.returncode == 1 and done.stdout == ""
    err = done.stderr
    assert "plugin 'broken_test' (group kvloom.general_plugins, distribution kvloom-test-broken-plugin 0.1.0) failed to load" in err
    assert "Traceback (most recent call last)" in err and "_read_required_setting" in err
    assert "RuntimeError: kvloom-test-broken-plugin fails on purpose while importing" in err


def test_kvloom_plugins_excludes_the_broken_plugin(install: Install) -> None:
    report = backends_json(install, plugins=["broken_plugin", "example_backend"], KVLOOM_PLUGINS="cpu,EXAMPLE_ATTN")
    assert report["selected"] == "EXAMPLE_ATTN"


def test_kvloom_plugins_leaves_out_the_oot_platform_and_backend(install: Install) -> None:
    plugins = ["example_backend", "example_platform"]
    report = backends_json(install, plugins=plugins, expect_rc=1, KVLOOM_PLUGINS="cpu", **PLATFORM_ON)
    assert report["platform"] == "cpu" and report["selected"] is None
    assert candidate(report, "EXAMPLE_ATTN")["reasons"] == [
        "installed (kvloom-example-attention-backend 0.1.0) but KVLOOM_PLUGINS does not list it"
    ]
    only_oot = backends_json(install, plugins=plugins, KVLOOM_PLUGINS="example_cpu,EXAMPLE_ATTN", **PLATFORM_ON)
    assert (only_oot["platform"], only_oot["selected"]) == ("example_cpu", "EXAMPLE_ATTN")


def test_kvloom_plugins_unknown_name_and_empty_value(install: Install) -> None:
    unknown = run(install, [*CLI, "backends"], ["example_backend"], KVLOOM_PLUGINS="cpu,NOT_A_PLUGIN")
    assert unknown.returncode == 1
    assert "KVLOOM_PLUGINS lists NOT_A_PLUGIN, which no installed plugin provides. Installed plugins: " in unknown.stderr
    assert "EXAMPLE_ATTN" in unknown.stderr and "cpu" in unknown.stderr
    empty = run(install, [*CLI, "backends"], ["example_backend"], KVLOOM_PLUGINS="")
    assert empty.returncode == 1
    assert "No kvloom platform is available" in empty.stderr
    assert "KVLOOM_PLUGINS leaves out the installed platform plugins" in empty.stderr


def test_incompatible_plugin_api_is_refused_naming_both_versions(install: Install) -> None:
    done = run(install, [*CLI, "backends"], ["api2_plugin"])
    assert done.returncode == 1
    assert ("plugin 'api2_test' (group kvloom.general_plugins, distribution kvloom-test-api2-plugin 0.1.0) "
            f"was written for kvloom plugin API 2.0, but this kvloom provides plugin API {PLUGIN_API_VERSION}") in done.stderr


def test_two_distributions_with_one_backend_name(install: Install) -> None:
    done = run(install, [*CLI, "backends"], ["example_backend", "dup_backend"])
    assert done.returncode == 1
    assert "Two attention backends are named 'EXAMPLE_ATTN': " in done.stderr
    assert "kvloom-example-attention-backend 0.1.0" in done.stderr and "kvloom-test-dup-backend 0.2.0" in done.stderr


# ---------------------------------------------------------------------- other plugin kinds

EXTENSIONS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json
    from types import SimpleNamespace
    import torch
    from kvloom import plugins
    from kvloom.interfaces import IterationStats, SchedulerStats
    from kvloom.lora.resolver import LoRAResolverRegistry
    from kvloom.models.registry import ModelRegistry

    plugins.load_plugins()
    plugins.load_plugins()  # idempotent
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=256), model=SimpleNamespace(served_model_name="m"))
    plugins.call_update_engine_config(config)

    processor = plugins.get_io_processor_cls("example_search")(None)
    request = processor.parse_data({"query": "q", "documents": ["a", "b"], "top_k": 1})
    prompts = processor.pre_process(request, request_id="r1")
    outputs = [SimpleNamespace(outputs=SimpleNamespace(data=torch.tensor(v))) for v in ([1.0, 0.0], [0.0, 1.0], [3.0, 0.0])]

    (logger_cls,) = [entry.target for entry in plugins.stat_logger_plugins()]
    stat_logger = logger_cls(config)
    stat_logger.record(SchedulerStats(num_running_reqs=3), IterationStats(num_generation_tokens=2))
    stat_logger.record(None, None)

    resolver = LoRAResolverRegistry.get_resolver("example_index")
    lora = asyncio.run(resolver.resolve_lora("base-model", "my_adapter"))
    missing = asyncio.run(resolver.resolve_lora("base-model", "other"))
    print(json.dumps({
        "archs": [ModelRegistry.is_supported(a) for a in ("KvloomTestLlamaForCausalLM", "KvloomTestQwen2ForCausalLM")],
        "max_num_seqs": config.scheduler.max_num_seqs,
        "io_processors": sorted(plugins.io_processor_plugins()),
        "prompts": prompts,
        "pooled": processor.post_process(outputs, request_id="r1"),
        "stat_logger": [logger_cls.__name__, stat_logger.steps, stat_logger.generation_tokens],
        "resolvers": LoRAResolverRegistry.get_supported_resolvers(),
        "lora": [lora.lora_name, lora.lora_path, lora.base_model_name, lora.lora_int_id > 0],
        "missing": missing,
    }))
    """
)


def test_general_io_processor_stat_logger_and_lora_resolver_plugins(install: Install, tmp_path: Path) -> None:
    adapter = tmp_path / "my_adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    index = tmp_path / "adapters.json"
    index.write_text(json.dumps({"my_adapter": str(adapter)}))
    names = "test_general_register,test_general_hooks,example_search,example_jsonl,example_index"
    done = run(
        install,
        [sys.executable, "-c", EXTENSIONS_SCRIPT],
        ["general_plugin", "example_io_processor", "example_stat_logger", "example_lora_resolver"],
        KVLOOM_PLUGINS=names,
        KVLOOM_LORA_INDEX=str(index),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["archs"] == [True, True]
    assert result["max_num_seqs"] == 64
    assert result["io_processors"] == ["example_search"]
    assert result["prompts"] == ["q", "a", "b"]
    assert result["pooled"] == {"results": [{"index": 1, "score": 1.0}]}  # [3, 0] is closest to [1, 0]
    assert result["stat_logger"] == ["JsonLinesStatLogger", 2, 2]
    assert result["resolvers"] == ["example_index"]
    assert result["lora"] == ["my_adapter", str(adapter), "base-model", True]
    assert result["missing"] is None


ENGINE_WITH_HOOK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from kvloom import LLM, SamplingParams

    os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"  # the core in this process, to read it
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="32MiB", max_num_seqs=256, cudagraph_mode="FULL")
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    core = llm.llm_engine.engine_core.core
    print(json.dumps({
        "config": llm.config.scheduler.max_num_seqs,
        "scheduler": core.scheduler.max_num_seqs,
        "runner": core.worker.runner.max_num_reqs,
        "tokens": len(out.outputs[0].token_ids),
    }))
    """
)


def _hook_calls(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_update_engine_config_hook_shapes_the_engine_that_starts(install: Install, tmp_path: Path) -> None:
    """The installed general plugin's kvloom_update_engine_config caps max_num_seqs at 64:
    the engine that starts schedules with the capped value. The hook runs once per engine
    config, after the platform's adjustment (the CPU platform turned CUDA graphs off), on
    the resolved EngineConfig."""
    model = str(tiny_model_dir("llama"))
    calls = tmp_path / "engine-hook-calls.jsonl"
    done = run(install, [sys.executable, "-c", ENGINE_WITH_HOOK_SCRIPT, model], ["general_plugin"],
               KVLOOM_PLATFORM="cpu", KVLOOM_TEST_GENERAL_PLUGIN_CALLS=str(calls))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"config": 64, "scheduler": 64, "runner": 64, "tokens": 2}
    (call,) = _hook_calls(calls)
    assert {k: v for k, v in call.items() if k != "pid"} == {
        "config_type": "EngineConfig", "platform": "cpu", "backend": call["backend"],
        "cudagraph_mode": "NONE", "max_num_seqs": 256,
    }

    # kvloom generate: the same hook, once, in the CLI's engine.
    cli_calls = tmp_path / "generate-hook-calls.jsonl"
    generate = run(install, [*CLI, "generate", "--model", model, "--prompt", "hello", "--raw", "--max-tokens", "2",
                             "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-num-seqs", "128"],
                   ["general_plugin"], KVLOOM_PLATFORM="cpu", KVLOOM_TEST_GENERAL_PLUGIN_CALLS=str(cli_calls))
    assert generate.returncode == 0, generate.stderr
    (cli_call,) = _hook_calls(cli_calls)
    assert (cli_call["config_type"], cli_call["max_num_seqs"], cli_call["cudagraph_mode"]) == ("EngineConfig", 128, "NONE")


def test_stat_logger_plugin_runs_in_kvloom_generate_unless_stats_are_off(install: Install, tmp_path: Path) -> None:
    generate = [*CLI, "generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hello", "--raw",
                "--max-tokens", "3", "--dtype", "float32", "--kv-cache-memory", "32MiB"]
    calls = tmp_path / "stats-on.jsonl"
    done = run(install, generate, ["example_stat_logger"], KVLOOM_PLATFORM="cpu", KVLOOM_STATS_JSONL=str(calls))
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [e["event"] for e in entries[:2]] == ["init", "engine_initialized"]
    records = [e["iteration"] for e in entries if e["event"] == "record" and e["iteration"] is not None]
    assert len(records) >= 3 and sum(r["num_prompt_tokens"] for r in records) > 0
    assert [f["finish_reason"] for r in records for f in r["finished_requests"]] == ["length"]

    off = tmp_path / "stats-off.jsonl"
    done = run(install, [*generate, "--disable-log-stats"], ["example_stat_logger"], KVLOOM_PLATFORM="cpu",
               KVLOOM_STATS_JSONL=str(off))
    assert done.returncode == 0, done.stderr
    assert not off.exists()


# ---------------------------------------------------------------------- console script


def test_kvloom_console_script(install: Install) -> None:
    script = Path(sys.executable).parent / "kvloom"
    assert script.is_file(), f"the kvloom console script is not installed next to {sys.executable}"
    done = run(install, [str(script), "backends", "--json"], ["example_backend"], KVLOOM_PLUGINS="cpu,EXAMPLE_ATTN")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["selected"] == "EXAMPLE_ATTN"


# ---------------------------------------------------------------------- with CPU_ATTN installed


def test_cpu_attn_outranks_the_oot_backend_on_the_cpu_platform(install: Install) -> None:
    pytest.importorskip("kvloom_backend_cpu")
    report = backends_json(install, plugins=["example_backend"], KVLOOM_PLUGINS="cpu,CPU_ATTN,EXAMPLE_ATTN")
    assert report["selected"] == "CPU_ATTN"
    assert report["candidates"][0]["name"] == "CPU_ATTN" and report["candidates"][0]["priority"] == 1
    assert candidate(report, "EXAMPLE_ATTN")["valid"]
    # Filtering CPU_ATTN out by KVLOOM_PLUGINS hands the choice to the OOT backend.
    filtered = backends_json(install, plugins=["example_backend"], KVLOOM_PLUGINS="cpu,EXAMPLE_ATTN")
    assert filtered["selected"] == "EXAMPLE_ATTN"
    assert candidate(filtered, "CPU_ATTN")["reasons"][0].endswith("but KVLOOM_PLUGINS does not list it")
