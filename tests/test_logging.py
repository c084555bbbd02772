"""The Python API speaks as vLLM's does (issue 18, item 5): ``import kvloom`` configures
the ``kvloom`` logger (``KVLOOM_CONFIGURE_LOGGING``, ``KVLOOM_LOGGING_LEVEL``); ``LLM()``
logs model load, KV-cache size and start time; ``generate``'s bar shows token rates; the
first GGUF conversion shows progress and its duration; no ``torch_dtype`` warning.

Logging configuration is process-wide (and the root conftest turns it off for pytest's
``caplog``), so these run in fresh interpreters."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers.model_fixtures import tiny_model_dir

LINE = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[<string>:3\] hello$", re.MULTILINE)


def _python(code: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("KVLOOM_CONFIGURE_LOGGING", "KVLOOM_LOGGING_LEVEL")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)


LOG_HELLO = "import logging, kvloom\nlogger = logging.getLogger('kvloom.example')\nlogger.info('hello')\n"


def test_import_configures_the_kvloom_logger_like_vllm():
    done = _python(LOG_HELLO)
    assert LINE.search(done.stderr), done.stderr


@pytest.mark.parametrize(
    "env", [{"KVLOOM_CONFIGURE_LOGGING": "0"}, {"KVLOOM_LOGGING_LEVEL": "WARNING"}], ids=["off", "warning"]
)
def test_logging_can_be_turned_off_or_down(env):
    done = _python(LOG_HELLO, **env)
    assert "hello" not in done.stderr, done.stderr


def test_llm_logs_its_start_and_generate_shows_token_rates():
    code = (
        "from kvloom import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir('llama'))!r}, max_num_seqs=4, max_model_len=64, disable_log_stats=True)\n"
        "llm.generate(['hello there', 'hi'], SamplingParams(temperature=0, max_tokens=4))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert re.search(r"\[core\.py:\d+\] Model loading took \d+\.\d+ s", err), err
    assert "KV cache size: 256 tokens (16 blocks of 16); maximum concurrency for 64 tokens per request: 4.00x" in err
    assert re.search(r"Engine core ready in \d+\.\d s \(\d+ KV blocks\): load \d+\.\d s, KV-cache sizing", err), err
    assert re.search(r"LLM engine for \S*/llama ready in \d+\.\d+ s", err), err
    assert re.search(r"est\. speed input: \d+\.\d\d toks/s, output: \d+\.\d\d toks/s", err), err
    assert "torch_dtype" not in err


def test_first_gguf_conversion_shows_progress_and_duration(tmp_path):
    from tests.helpers.gguf_fixtures import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model_dir("llama"), gguf_path, "llama")
    code = (
        "from tests.helpers.model_fixtures import make_test_engine_config\n"
        "from kvloom.loader.gguf_loader import gguf_weights\n"
        "from kvloom.loader.model_loader import checkpoint_weight_names, get_model\n"
        f"config = make_test_engine_config({str(tiny_model_dir('llama'))!r})\n"
        "names = checkpoint_weight_names(get_model(config, 'cpu'))\n"
        f"assert len(dict(gguf_weights({str(gguf_path)!r}, config.model.hf_config, names))) == len(names)\n"
    )
    done = _python(code, KVLOOM_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    assert re.search(r"Dequantizing tiny\.gguf: 100%.*tensor", done.stderr), done.stderr
    assert re.search(r"Dequantized \d+ GGUF tensors of tiny\.gguf in \d+\.\d s", done.stderr), done.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signal")
def test_sigusr1_dumps_stacks_and_process_goes_on() -> None:
    """``dump_stacks_on_sigusr1``: SIGUSR1 prints the Python stacks to stderr, and the
    process keeps running (the default action of SIGUSR1 would end it)."""
    code = (
        "import os, signal, time\n"
        "from kvloom.logger import dump_stacks_on_sigusr1\n"
        "def waiting_here():\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.2)\n"
        "    print('still alive', flush=True)\n"
        "dump_stacks_on_sigusr1()\n"
        "waiting_here()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "still alive" in done.stdout
    assert "waiting_here" in done.stderr  # the stack names the function the process was in
