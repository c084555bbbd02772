"""docs/plugins.md shows the example packages' real files, so the guide cannot rot.

A fenced code block whose info string names a file (```` ```python file=plugins/examples/model/kvloom_example_model/model.py ````)
must be that file, character for character; every file of every example package (its
``pyproject.toml`` and its modules) must be shown; and every ``python`` or ``toml`` block of
the guide must name its file (plugin code in the guide is example-package code, nothing
else). After changing an example, rewrite the blocks from the files with::

    python -m tests.test_plugin_docs --write
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "plugins.md"
EXAMPLES = REPO / "plugins" / "examples"

#: A fenced block: the info string (language, then ``file=PATH`` when it reproduces a file) and its body.
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
FILE_ATTR = re.compile(r"(?:^|\s)file=(?P<path>\S+)")


def blocks(text: str) -> list[tuple[str, str | None, re.Match[str]]]:
    """(language, file path or None, match) of every fenced block of ``text``."""
    found = []
    for match in FENCE.finditer(text):
        info = match["info"].strip()
        language = info.split()[0] if info else ""
        path = FILE_ATTR.search(info)
        found.append((language, path["path"] if path else None, match))
    return found


def render(text: str) -> str:
    """``text`` with every ``file=`` block's body replaced by the file's content."""

    def body(match: re.Match[str]) -> str:
        path = FILE_ATTR.search(match["info"])
        if path is None:
            return match[0]
        content = (REPO / path["path"]).read_text()
        return f"```{match['info']}\n{content.rstrip(chr(10))}\n```"

    return FENCE.sub(body, text)


def example_files() -> list[str]:
    """Every file of every example package that the guide must show."""
    files = []
    for package in sorted(p for p in EXAMPLES.iterdir() if (p / "pyproject.toml").is_file()):
        files.append(package / "pyproject.toml")
        for module_dir in sorted(p for p in package.iterdir() if p.is_dir() and p.name.startswith("kvloom_")):
            files.extend(sorted(module_dir.glob("*.py")))
    return [str(f.relative_to(REPO)) for f in files]


def test_file_blocks_are_the_files() -> None:
    text = GUIDE.read_text()
    stale = []
    for _, path, match in blocks(text):
        if path is None:
            continue
        assert (REPO / path).is_file(), f"docs/plugins.md shows {path}, which does not exist"
        if match["body"].rstrip("\n") != (REPO / path).read_text().rstrip("\n"):
            stale.append(path)
    assert not stale, (
        f"docs/plugins.md shows outdated copies of {stale}; run `python -m tests.test_plugin_docs --write`"
    )


def test_every_example_file_is_shown() -> None:
    shown = {path for _, path, _ in blocks(GUIDE.read_text()) if path}
    missing = [f for f in example_files() if f not in shown]
    assert len(example_files()) >= 12
    assert not missing, f"docs/plugins.md does not show {missing} (add a block with file=PATH)"


def test_plugin_code_blocks_name_their_file() -> None:
    unnamed = [
        match["body"].splitlines()[0] if match["body"] else "(empty)"
        for language, path, match in blocks(GUIDE.read_text())
        if language in ("python", "toml") and path is None
    ]
    assert not unnamed, f"python/toml blocks in docs/plugins.md must reproduce an example file: {unnamed}"


def test_example_files_do_not_break_the_fences() -> None:
    for path in example_files():
        lines = (REPO / path).read_text().splitlines()
        assert not any(line.startswith("```") for line in lines), f"{path}: a line starting with ``` ends its block"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_plugin_docs --write")
    GUIDE.write_text(render(GUIDE.read_text()))
    print(f"rewrote the file blocks of {GUIDE.relative_to(REPO)}")
