"""What a vLLM user meets first on the command line (issue 18): a quick ``--help``, one
clear line instead of a traceback, flags named in errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
