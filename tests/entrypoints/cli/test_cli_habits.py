"""What a vLLM user meets first on the command line (issue 18): a quick ``--help``, one
clear line instead of a traceback, flags named in errors."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom.entrypoints import llm as llm_module
from kvloom.testing import resolve_engine_config, run_cli
from kvloom.testing.models import make_tiny_model

HEAVY_MODULES = ("torch", "transformers")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_help_does_not_import_torch(argv):
    code = (
        "import sys\n"
        "from kvloom.entrypoints.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: kvloom" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr

# ---------------------------------------------------------------------- errors, not tracebacks


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # faster; the messages are the same


def test_truncated_safetensors_names_the_file(tmp_path, capsys, in_process):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert run_cli(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert f"kvloom: error: weights: cannot read {weights} (5000 bytes)" in err
    assert "truncated" in err and "Traceback" not in err


def test_unexpected_exception_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    class Boom:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("boom")

    monkeypatch.setattr(llm_module, "LLM", Boom)
    assert run_cli(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "kvloom: error: RuntimeError: boom (run with --debug or KVLOOM_LOGGING_LEVEL=DEBUG for the traceback)"
    )
    assert run_cli(["generate", "--prompt", "hi", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "--temperature: Input should be greater than or equal to 0 "
                                "(allowed range: 0.0 <= temperature <= 100.0)"),
        ("--top-p", "2", "--top-p: Input should be less than or equal to 1 (allowed range: 0.0 < top_p <= 1.0)"),
        ("--max-tokens", "0", "--max-tokens: Input should be greater than or equal to 1 (allowed range: 1 <= max_tokens"),
    ],
)
def test_bad_sampling_flags_name_the_flag_and_the_range(flag, value, message, capsys):
    assert run_cli(["generate", "--prompt", "hi", flag, value]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert "pydantic" not in err and "validation error" not in err and "Traceback" not in err


def test_chat_without_a_template_names_the_flag_and_the_flag_works(tmp_path, monkeypatch, capsys, in_process):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    (model_dir / "chat_template.jinja").unlink()
    argv = ["chat", "--model", str(model_dir), "--max-tokens", "3", "--disable-log-stats"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert run_cli(argv) == 1
    assert "pass one with --chat-template PATH_OR_STRING" in capsys.readouterr().err
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert run_cli([*argv, "--chat-template", str(template)]) == 0
    assert capsys.readouterr().out.strip()  # a reply was streamed


def test_sliding_window_model_keeps_its_full_length(tmp_path):
    """The window is honoured by the attention backends, so the context is not capped to it."""
    model_dir = make_tiny_model("mistral", tmp_path, sliding_window=32)
    full = resolve_engine_config(model=str(model_dir)).model.max_model_len
    assert full > 32
    assert resolve_engine_config(model=str(model_dir), max_model_len=full).model.max_model_len == full


def test_generate_runs_the_engine_core_in_its_own_process_only_when_asked(monkeypatch):
    """A one-shot command skips the second interpreter (seconds of its start)."""
    seen = []

    class Recording:
        def __init__(self, *args, **kwargs):
            seen.append(os.environ.get("KVLOOM_ENABLE_MULTIPROCESSING"))
            raise RuntimeError("stop")

    monkeypatch.setattr(llm_module, "LLM", Recording)
    monkeypatch.delenv("KVLOOM_ENABLE_MULTIPROCESSING", raising=False)
    run_cli(["generate", "--prompt", "hi"])
    assert "KVLOOM_ENABLE_MULTIPROCESSING" not in os.environ  # restored
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "1")
    run_cli(["generate", "--prompt", "hi"])
    monkeypatch.delenv("KVLOOM_ENABLE_MULTIPROCESSING")
    run_cli(["generate", "--prompt", "hi", "--data-parallel-size", "2"])
    assert seen == ["0", "1", None]


def test_offline_commands_take_the_model_as_a_positional_argument(monkeypatch, capsys):
    """As ``kvloom serve MODEL`` (and vLLM's commands) do: generate, chat and bench throughput."""
    from kvloom.entrypoints.cli import bench_throughput

    models = []

    class Recording:
        def __init__(self, *args, **kwargs):
            models.append(kwargs["model"])
            raise RuntimeError("stop")

    monkeypatch.setattr(llm_module, "LLM", Recording)
    monkeypatch.setattr(bench_throughput, "run_throughput", lambda kwargs, *rest: models.append(kwargs["model"]) or {})
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    run_cli(["generate", "/m/gen", "--prompt", "hi"])
    run_cli(["chat", "/m/chat"])
    run_cli(["bench", "throughput", "/m/bench", "--num-prompts", "1"])
    run_cli(["generate", "--model", "/m/flag", "--prompt", "hi"])
    assert models == ["/m/gen", "/m/chat", "/m/bench", "/m/flag"]
    capsys.readouterr()
    assert run_cli(["generate", "/m/a", "--model", "/m/b", "--prompt", "hi"]) != 0
    assert "MODEL '/m/a' and --model '/m/b' disagree" in capsys.readouterr().err
