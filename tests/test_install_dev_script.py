"""scripts/install-dev.sh is quiet on success (one line a step, pip's notices in a log) and,
when a step fails, says which and shows the end of the log. Run with a stand-in Python
that answers ``-m venv``, ``-m pip`` (hundreds of lines, as the editable builds print)
and ``-c`` in milliseconds."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-dev.sh"

STUB = """#!/usr/bin/env bash
# A stand-in python3 for install-dev.sh.
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
  for i in $(seq 300); do echo "SetuptoolsDeprecationWarning: notice $i"; done
  case " $* " in *" $STUB_FAIL "*) echo "ERROR: No matching distribution found for torch==2.13.0"; exit 1 ;; esac
  exit 0
fi
[ "$1" = -c ] && echo "install-dev: kvloom 0.0 torch 0.0"
"""


def _run(tmp_path: Path, fail: str = "-") -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PYTHON": str(stub), "STUB_FAIL": fail, "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "venv")], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_success_is_one_line_a_step(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and done.stderr == "", done.stdout + done.stderr
    assert all(line.startswith("install-dev: ") for line in lines)
    assert "Setuptools" not in done.stdout
    (log,) = tmp_path.glob("kvloom-install-dev.*")
    assert log.read_text().count("SetuptoolsDeprecationWarning") == 900  # kept for whoever needs it
    assert lines[-1] == f"install-dev: ready (full log: {log})"


def test_a_failed_step_names_itself_and_shows_the_end_of_the_log(tmp_path: Path) -> None:
    done = _run(tmp_path, fail="requirements-dev.txt")
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1].endswith("(minutes) ... FAILED")
    assert "install-dev: 'torch (CPU), kvloom and its first-party plugins" in done.stderr
    assert done.stderr.rstrip().endswith("ERROR: No matching distribution found for torch==2.13.0")
    assert len(done.stderr.splitlines()) <= 42
