"""Models named by Hugging Face Hub id, as vLLM takes them: ``org/name``, and GGUF files
as vLLM's GGUF loader names them, ``org/name:Q4_K_M`` (a quantization type) or
``org/name/file.gguf`` (a file in the repository).

An id resolves through ``huggingface_hub`` and its cache (``HF_HUB_CACHE``, ``HF_HOME``;
``--download-dir`` is the ``cache_dir``), at a ``revision`` (branch, tag or commit;
default ``main``):

* online, the repository's file list picks the files kvloom loads (config, generation
  config, tokenizer files, and the weights of one format, or the one GGUF file), and
  ``snapshot_download`` fetches those the cache lacks (huggingface_hub shows a progress
  bar for each file it actually downloads);
* with ``HF_HUB_OFFLINE=1``, or when the hub cannot be reached, the cached snapshot of the
  revision is used; a model the cache lacks is an error naming the cache folder it
  looked in and why it did not download.

Only ``resolve_hub_model`` and ``resolve_hub_tokenizer`` are for other modules; both
return None for a name that cannot be a hub id, so local paths keep their own errors.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The files of a model's folder kvloom reads besides its weights (top level only).
CONFIG_FILES = ("config.json", "generation_config.json")
#: Tokenizer files (transformers' fast and slow tokenizers, chat templates).
TOKENIZER_PATTERNS = (
    "tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model",
    "chat_template.*", "*.tiktoken",
)  # fmt: skip
SAFETENSORS_PATTERNS = ("*.safetensors", "model.safetensors.index.json")
PT_PATTERNS = ("*.bin", "pytorch_model.bin.index.json")

#: A repository name segment, as the hub allows them.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"{_SEGMENT}(/{_SEGMENT})?")
_GGUF_QUANT = re.compile(rf"({_SEGMENT}/{_SEGMENT}):([A-Za-z0-9_+-]+)")
#: Quantization-type spellings in GGUF file names beyond the tensor types (Q4_K_M is Q4_K, medium).
_QUANT_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")


@dataclass(frozen=True)
class HubReference:
    """A model named on the hub: ``repo_id``, and for GGUF either the quantization type
    (``org/name:Q4_K_M``) or the file's path in the repository (``org/name/file.gguf``)."""

    repo_id: str
    gguf_quant: str | None = None
    gguf_file: str | None = None


def is_gguf_quant_type(name: str) -> bool:
    """Whether ``name`` names a GGML quantization type (``Q4_K``, ``Q8_0``, ``F16``), also with a
    size suffix (``Q4_K_M``) or a publisher's prefix (``UD-Q4_K_XL``)."""
    from gguf import GGMLQuantizationType

    name = name.upper().rsplit("-", 1)[-1]
    candidates = [name] + [name.removesuffix(s) for s in _QUANT_SUFFIXES if name.endswith(s)]
    return any(c in GGMLQuantizationType.__members__ for c in candidates)


def parse_hub_reference(model: str) -> HubReference | None:
    """The hub reference ``model`` spells, or None when it cannot be one (a path such as
    ``./m``, ``/m`` or ``~/m``, or more than ``org/name`` without a ``.gguf`` file)."""
    if model.startswith((".", "/", "~")) or "\\" in model or "--" in model or ".." in model:
        return None
    quant = _GGUF_QUANT.fullmatch(model)
    if quant:
        return HubReference(quant.group(1), gguf_quant=quant.group(2)) if is_gguf_quant_type(quant.group(2)) else None
    if _REPO_ID.fullmatch(model):
        return HubReference(model)
    parts = model.split("/")
    if len(parts) > 2 and model.endswith(".gguf") and _REPO_ID.fullmatch("/".join(parts[:2])):
        return HubReference("/".join(parts[:2]), gguf_file="/".join(parts[2:]))
    return None


def resolve_hub_model(model: str, revision: str | None, cache_dir: str | None, load_format: str) -> Path | None:
    """The local folder (or ``.gguf`` file) of hub id ``model`` at ``revision``, fetched into
    the cache if needed; None if ``model`` is not a hub id."""
    ref = parse_hub_reference(model)
    if ref is None:
        return None

    def select(files: list[str], where: str) -> tuple[list[str], str | None]:
        return _model_files(model, ref, files, load_format, where)

    return _resolve(model, ref.repo_id, revision, cache_dir, select, "model")


def resolve_hub_tokenizer(tokenizer: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The local folder holding the tokenizer of hub id ``tokenizer`` (``--tokenizer``, at
    ``--tokenizer-revision``); None if ``tokenizer`` is not a plain hub id."""
    ref = parse_hub_reference(tokenizer)
    if ref is None or ref.gguf_quant or ref.gguf_file:
        return None

    def select(files: list[str], where: str) -> tuple[list[str], str | None]:
        wanted = _matching(files, ("config.json", *TOKENIZER_PATTERNS))
        if wanted in ([], ["config.json"]):
            raise FileNotFoundError(f"tokenizer: {where} has no tokenizer files")
        return wanted, None

    return _resolve(tokenizer, ref.repo_id, revision, cache_dir, select, "tokenizer")


# ----------------------------------------------------------------- which files


def _matching(files: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The top-level ``files`` matching any of ``patterns``."""
    return [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in patterns)]


def _model_files(
    model: str, ref: HubReference, files: list[str], load_format: str, where: str
) -> tuple[list[str], str | None]:
    """(the files of ``files`` (those of ``where``) kvloom loads for ``ref``, the GGUF file
    among them or None)."""
    if ref.gguf_file:
        if ref.gguf_file not in files:
            raise FileNotFoundError(f"model: {where} has no file {ref.gguf_file!r}")
        return [ref.gguf_file], ref.gguf_file
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ref.gguf_quant:
        return _gguf_of_quant(ref, ggufs, where)
    if "config.json" not in files:
        if len(ggufs) == 1:  # a GGUF-only repository, as a local folder holding one .gguf file
            return ggufs, ggufs[0]
        listed = f"; its GGUF files: {', '.join(ggufs)} (name one as {ref.repo_id}:QUANT_TYPE or " \
                 f"{ref.repo_id}/FILE.gguf)" if ggufs else ""  # fmt: skip
        raise FileNotFoundError(f"model: {where} has no config.json{listed}")
    if load_format == "gguf":
        raise ValueError(f"load_format: 'gguf' needs a .gguf file, but {model!r} names an HF model repository "
                         f"(name its GGUF file as {ref.repo_id}:QUANT_TYPE or {ref.repo_id}/FILE.gguf)")  # fmt: skip
    wanted = _matching(files, (*CONFIG_FILES, *TOKENIZER_PATTERNS))
    if load_format == "dummy":
        return wanted, None
    safetensors = _matching(files, SAFETENSORS_PATTERNS)
    hf_named = [f for f in safetensors if not f.startswith("consolidated")]
    if hf_named:  # Mistral's consolidated*.safetensors repeat the HF-named weights
        safetensors = hf_named
    pt = _matching(files, PT_PATTERNS)
    if load_format == "safetensors" or (load_format == "auto" and safetensors):
        weights = safetensors
    else:
        weights = pt
    if not weights:
        kind = {"safetensors": "safetensors", "pt": ".bin"}.get(load_format, "safetensors or .bin")
        raise FileNotFoundError(f"model: {where} has no {kind} weight files")
    return wanted + weights, None


def _gguf_of_quant(ref: HubReference, ggufs: list[str], where: str) -> tuple[list[str], str]:
    """The GGUF file of ``ref.gguf_quant`` (vLLM's rule: ``*-QUANT.gguf`` or
    ``*-QUANT-*.gguf``, in the repository or one folder down; with several, the one with the
    fewest dashes, i.e. not a split shard)."""
    quant = ref.gguf_quant.lower()  # type: ignore[union-attr]
    patterns = (f"*-{quant}.gguf", f"*-{quant}-*.gguf")
    matches = [f for f in ggufs if f.count("/") <= 1 and any(fnmatch.fnmatch(f.lower(), p) for p in patterns)]
    if not matches:
        listed = ", ".join(ggufs) or "none"
        raise FileNotFoundError(f"model: {where} has no GGUF file of quantization type "
                                f"{ref.gguf_quant} (its GGUF files: {listed})")  # fmt: skip
    chosen = min(matches, key=lambda f: (f.count("-"), f))
    return [chosen], chosen


# ----------------------------------------------------------------- the cache and the hub


def _cache_root(cache_dir: str | None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def _repo_folder(cache_dir: str | None, repo_id: str) -> Path:
    """Where huggingface_hub keeps ``repo_id`` in the cache (its documented layout)."""
    return _cache_root(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def _snapshot_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


#: (files, where they are, in words) -> (the files to load, the GGUF file among them or None).
Selector = Callable[[list[str], str], tuple[list[str], str | None]]


def _resolve(name: str, repo_id: str, revision: str | None, cache_dir: str | None, select: Selector,
             what: str) -> Path:  # fmt: skip
    """Fetch what ``select`` picks of ``repo_id`` (online), or find it in the cache
    (offline, or when the hub cannot be reached); the snapshot folder, or the file
    ``select`` names in it."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    revision = revision or "main"
    why_cached = "HF_HUB_OFFLINE is set (unset it to let kvloom download it)"
    if not constants.HF_HUB_OFFLINE:
        try:
            remote = HfApi().list_repo_files(repo_id, revision=revision)
        except RevisionNotFoundError:
            raise FileNotFoundError(f"{what}: the hub repository {repo_id!r} has no revision {revision!r}") from None
        except RepositoryNotFoundError as exc:
            raise FileNotFoundError(
                f"{what}: {name!r} is not a local folder or .gguf file, and the Hugging Face Hub has no model "
                f"repository {repo_id!r} that this machine may read (a private or gated one needs a token: "
                f"HF_TOKEN or `hf auth login`): {str(exc).splitlines()[0]}"
            ) from None
        except Exception as exc:  # noqa: BLE001 (no network, a proxy, the hub down: the cache may still hold the model)
            why_cached = f"the Hugging Face Hub could not be reached ({type(exc).__name__}: {exc})"
            logger.warning("%s; looking for %s in the cache", why_cached[0].upper() + why_cached[1:], repo_id)
        else:
            files, entry = select(remote, f"the hub repository {repo_id!r} (revision {revision})")
            logger.info("Fetching %s (revision %s, %d files) from the Hugging Face Hub into %s (files already there "
                        "are not downloaded again)", repo_id, revision, len(files), _cache_root(cache_dir))  # fmt: skip
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=files))
            return folder / entry if entry else folder
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{what}: {name!r} is not a local folder or .gguf file, and the Hugging Face cache has no snapshot of "
            f"{repo_id!r} at revision {revision!r} (looked in {_repo_folder(cache_dir, repo_id)}); kvloom did not "
            f"download it because {why_cached}"
        ) from None
    _, entry = select(_snapshot_files(folder), f"the cached snapshot {folder}")
    logger.info("Using %s (revision %s) from the Hugging Face cache at %s (%s)", repo_id, revision, folder, why_cached)
    return folder / entry if entry else folder
