"""When stat loggers run: ``record()`` after every engine step, ``log()`` when
``log_stats_interval`` has passed (checked after each step) and once more when the engine
shuts down (``LLMEngine.shutdown``, ``AsyncLLM.shutdown``; ``kvloom generate``, ``chat``
and ``bench throughput`` shut their engine down at the end), so the last step's
``record()`` is always followed by a ``log()``. A ``log()`` that raises at shutdown is
logged and the other loggers still run. The interval must be > 0."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest
from pydantic import ValidationError

from kvloom import LLM, SamplingParams, plugins
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.async_llm import AsyncLLM
from kvloom.engine.frontend import Frontend
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.plugins import STAT_LOGGER_PLUGINS
from kvloom.testing import resolve_engine_config, run_cli
from kvloom_registry import PluginEntry
from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.serve_fakes import make_config


class Probe(StatLoggerBase):
    """Records the order of its calls; ``instances`` holds every probe built."""

    instances: list["Probe"] = []

    def __init__(self, config, engine_index: int = 0) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, engine_index)
        self.events: list[str] = []
        Probe.instances.append(self)

    def record(self, scheduler_stats, iteration_stats, engine_idx: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.events.append("record")

    def log(self) -> None:
        self.events.append("log")


class Failing(Probe):
    def log(self) -> None:
        super().log()
        raise RuntimeError("log() broke")


@pytest.fixture
def stat_logger_plugins(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    found: dict[str, type] = {}
    monkeypatch.setattr(
        plugins,
        "stat_logger_plugins",
        lambda: [PluginEntry(name, STAT_LOGGER_PLUGINS, "probe", "1.0", "-", cls) for name, cls in found.items()],
    )
    Probe.instances = []
    return found


ENGINE = dict(dtype="float32", kv_cache_memory="32MiB", log_stats_interval=3600.0)
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_llm_engine_logs_once_more_at_shutdown(stat_logger_plugins: dict[str, type]) -> None:
    stat_logger_plugins["probe"] = Probe
    llm = LLM(str(tiny_model_dir("llama")), **ENGINE)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], PARAMS, use_tqdm=False)
    (probe,) = Probe.instances
    assert probe.events and set(probe.events) == {"record"}  # the interval (an hour) never passed
    llm.llm_engine.shutdown()
    assert probe.events[-1] == "log" and probe.events.count("log") == 1
    llm.llm_engine.shutdown()  # a second shutdown logs nothing more
    assert probe.events.count("log") == 1


def test_log_runs_after_a_step_once_the_interval_passed(stat_logger_plugins: dict[str, type]) -> None:
    stat_logger_plugins["probe"] = Probe
    llm = LLM(str(tiny_model_dir("llama")), **{**ENGINE, "log_stats_interval": 1e-9})
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    (probe,) = Probe.instances
    assert probe.events[:2] == ["record", "log"] and probe.events[-1] == "log"
    steps = probe.events.count("record")
    assert probe.events == ["record", "log"] * steps


def test_async_llm_logs_once_more_at_shutdown(stat_logger_plugins: dict[str, type]) -> None:
    stat_logger_plugins["probe"] = Probe
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir("llama")), **ENGINE))

    async def run() -> None:
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, PARAMS, "r1"):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    (probe,) = Probe.instances
    assert "record" in probe.events and probe.events[-1] == "log" and probe.events.count("log") == 1


def test_a_failing_log_at_shutdown_does_not_stop_the_others(
    stat_logger_plugins: dict[str, type], caplog: pytest.LogCaptureFixture
) -> None:
    stat_logger_plugins["failing"] = Failing
    stat_logger_plugins["probe"] = Probe
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32")
    frontend = Frontend(config, log_stats=True)
    frontend.start_stat_loggers(None)
    with caplog.at_level(logging.ERROR):
        frontend.log_stats_at_shutdown()
    failing, probe = Probe.instances
    assert failing.events == ["log"] and probe.events == ["log"]
    assert "Stat logger Failing failed in log() at shutdown" in caplog.text and "log() broke" in caplog.text


def test_log_stats_interval_must_be_positive() -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="log_stats_interval"):
            EngineArgs(log_stats_interval=bad)
    config = make_config()
    with pytest.raises(ValidationError, match="log_stats_interval"):
        config.observability.log_stats_interval = 0


CLI_RUNS = {
    "generate": ["generate", "--prompt", "Hello", "--raw", "--max-tokens", "3"],
    "chat": ["chat", "--max-tokens", "3"],
    "bench throughput": ["bench", "throughput", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"],
}


@pytest.mark.parametrize("command", list(CLI_RUNS))
def test_offline_commands_end_with_a_log(
    stat_logger_plugins: dict[str, type], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:  # fmt: skip
    stat_logger_plugins["probe"] = Probe
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))  # chat: one turn, then end of input
    argv = [*CLI_RUNS[command], "--model", str(tiny_model_dir("llama")), "--dtype", "float32",
            "--kv-cache-memory", "32MiB", "--log-stats-interval", "3600"]  # fmt: skip
    assert run_cli(argv) == 0
    capsys.readouterr()
    (probe,) = Probe.instances
    assert "record" in probe.events and probe.events[-1] == "log" and probe.events.count("log") == 1


def test_a_failing_periodic_log_does_not_stop_generation(
    stat_logger_plugins: dict[str, type], caplog: pytest.LogCaptureFixture
) -> None:
    stat_logger_plugins["failing"] = Failing
    stat_logger_plugins["probe"] = Probe
    llm = LLM(str(tiny_model_dir("llama")), **{**ENGINE, "log_stats_interval": 1e-9})
    with caplog.at_level(logging.ERROR):
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    failing, probe = Probe.instances
    assert failing.events == probe.events and probe.events.count("log") == probe.events.count("record")
    assert "Stat logger Failing failed in log()" in caplog.text
