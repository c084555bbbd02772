"""A Hugging Face Hub cache laid out on disk as huggingface_hub writes it, for tests of
models named by hub id (CI has no hub):

    <cache>/models--org--name/blobs/<sha256 of the file>
    <cache>/models--org--name/snapshots/<commit>/<file> -> ../../blobs/<sha256>
    <cache>/models--org--name/refs/<revision>             (the commit, for a branch or tag)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def add_to_hf_cache(cache: Path, repo_id: str, files_dir: Path, revision: str = "main") -> Path:
    """Put every file of ``files_dir`` (recursively) into ``cache`` as ``repo_id`` at
    ``revision`` (a branch or tag name); returns the snapshot folder. Each call is a new
    commit, named by the hash of its files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in files_dir.rglob("*") if p.is_file())
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    commit = hashlib.sha1("".join(digests.values()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for path, digest in digests.items():
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(path.read_bytes())
        link = snapshot / path.relative_to(files_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


#: The repository ``make_tiny_hub`` lays out.
TINY_REPO = "kvloom-test/tiny-llama"


def make_tiny_hub(root: Path) -> dict[str, Path]:
    """A cache in ``root / "cache"`` holding ``TINY_REPO``, the tiny random Llama, at branch
    main with a 128-token context and at branch "other" with 256 (so a test can tell
    which was loaded); returns {"cache", "main", "other", "main_files"} (the last: the
    folder the main snapshot was made from)."""
    from kvloom.testing.models import make_tiny_model

    cache = root / "cache"
    main = make_tiny_model("llama", root / "main", max_position_embeddings=128)
    other = Path(shutil.copytree(main, root / "other"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return {
        "cache": cache,
        "main": add_to_hf_cache(cache, TINY_REPO, main),
        "other": add_to_hf_cache(cache, TINY_REPO, other, revision="other"),
        "main_files": main,
    }
