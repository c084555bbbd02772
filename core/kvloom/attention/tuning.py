"""Attention backends ordered by measurement: the results of ``kvloom backends tune``.

A platform's priority list is one order for every model and every device of a family.
``kvloom backends tune MODEL`` times each valid backend's attention for one step of the
model's shape on this device (``tune_timing.py``) and caches the result as JSON under
``$KVLOOM_CACHE_DIR/backend_tune/``, keyed by ``TuneKey``: the device's name and compute
capability, the attention shape (head size, query and KV heads), the model dtype, the
KV-cache dtype, the block size (None: each backend at its own preferred size) and kvloom's
version. Selection (``attention/selector.py``) then puts the measured valid candidates
first, fastest first, when a tune exists for the key; an explicit ``--attention-backend``
is never overridden.

What is timed (``STEP_CASES``): uniform decode steps at batch 1, 16, 64 and 256 over 1,024
cached tokens (in a full CUDA graph where the backend supports one, as the engine's
default ``FULL_AND_PIECEWISE`` runs them), and a mixed step of 64 such decodes with a
512-token prefill chunk after 1,024 cached tokens (eager, as a piecewise step runs
attention). Each step is the builder's per-step work on the host (its ``plan``) plus every
layer's forward, timed back to back as the engine issues them, so a backend's host work
counts where it is not hidden behind the device. A backend's score is the sum of its
step times.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvloom.attention.backend import AttentionSelectorConfig, dtype_name
from kvloom.utils import kvloom_cache_dir

if TYPE_CHECKING:
    from kvloom.attention.backend import AttentionBackend
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: The folder under ``$KVLOOM_CACHE_DIR`` that holds one JSON file per tune.
TUNE_DIR = "backend_tune"


@dataclass(frozen=True)
class TuneKey:
    """What a tune is valid for: the device, the attention shape, the dtypes, the block size
    (None: each backend at its preferred size) and the kvloom version that measured it."""

    device_name: str
    capability: str | None
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    kv_cache_dtype: str
    block_size: int | None
    kvloom_version: str

    @classmethod
    def of(cls, platform: type[Platform], config: AttentionSelectorConfig) -> TuneKey | None:
        """The key of ``config`` on ``platform``'s device here; None where no tune can
        apply: the device is absent, the heads are unknown (``kvloom backends`` without
        ``--model``), or the model uses MLA (not tuned yet)."""
        if config.use_mla or config.num_heads is None or config.num_kv_heads is None or not platform.is_available():
            return None
        from kvloom import __version__

        capability = config.device_capability
        return cls(
            device_name=platform.get_device_name(),
            capability=str(capability) if capability is not None else None,
            head_size=config.head_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            dtype=dtype_name(config.dtype),
            kv_cache_dtype=config.kv_cache_dtype,
            block_size=config.block_size,
            kvloom_version=__version__,
        )

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]
        return f"{digest}.json"


@dataclass(frozen=True)
class StepCase:
    """One timed attention step: the requests' query and sequence lengths; ``decode``:
    a uniform single-token batch (run in a full CUDA graph where the backend can)."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    decode: bool


def _decode(batch: int, context: int) -> StepCase:
    return StepCase(f"decode {batch}", (1,) * batch, (context,) * batch, True)


def _mixed(decodes: int, context: int, chunk: int, prefix: int) -> StepCase:
    return StepCase(f"mixed {decodes}+{chunk}", (1,) * decodes + (chunk,), (context,) * decodes + (prefix + chunk,),
                    False)  # fmt: skip


#: The steps ``kvloom backends tune`` times (see the module docstring).
STEP_CASES: tuple[StepCase, ...] = (
    _decode(1, 1024), _decode(16, 1024), _decode(64, 1024), _decode(256, 1024), _mixed(64, 1024, 512, 1024),
)  # fmt: skip

#: ``time_step(backend, config, case, num_layers)``: milliseconds of one step of ``case``
#: over ``num_layers`` layers (``tune_timing.cuda_step_time`` on a GPU; tests pass fakes).
StepTimer = Callable[["type[AttentionBackend]", AttentionSelectorConfig, StepCase, int], float]


@dataclass
class BackendTimes:
    """One backend's measured steps (ms, by case name) at ``block_size``, or why it could
    not be measured (``error``)."""

    name: str
    block_size: int
    times_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def total_ms(self) -> float | None:
        """The score selection orders by: the sum of the step times (None: not measured)."""
        return None if self.error is not None or not self.times_ms else sum(self.times_ms.values())


@dataclass
class BackendTune:
    """The result of one ``kvloom backends tune`` (what the cache file holds)."""

    key: TuneKey
    backends: list[BackendTimes]
    num_layers: int
    created: str
    model: str = ""

    def total_ms(self, name: str) -> float | None:
        """``name``'s score, None when it was not measured (absent or failed)."""
        times = next((b for b in self.backends if b.name == name), None)
        return times.total_ms if times is not None else None

    def fastest_first(self) -> list[str]:
        """The measured backends, fastest first."""
        measured = [(b.total_ms, b.name) for b in self.backends if b.total_ms is not None]
        return [name for _, name in sorted(measured)]

    def to_json(self) -> dict[str, Any]:
        return {"key": asdict(self.key), "num_layers": self.num_layers, "created": self.created, "model": self.model,
                "backends": [asdict(b) for b in self.backends]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackendTune:
        return cls(key=TuneKey(**data["key"]), num_layers=int(data["num_layers"]), created=str(data["created"]),
                   model=str(data.get("model", "")), backends=[BackendTimes(**b) for b in data["backends"]])  # fmt: skip


def tune_path(key: TuneKey) -> Path:
    """``$KVLOOM_CACHE_DIR/backend_tune/<hash of the key>.json``."""
    return kvloom_cache_dir() / TUNE_DIR / key.file_name()


def save_tune(tune: BackendTune) -> Path:
    """Write ``tune`` to its cache file (atomically: a reader never sees half a file)."""
    path = tune_path(tune.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(tune.to_json(), indent=2))
    partial.replace(path)
    return path


def load_tune(key: TuneKey) -> BackendTune | None:
    """The cached tune for ``key``; None when there is none. A file that cannot be read as
    a tune of this key is ignored with a warning naming it (the platform's order then holds)."""
    path = tune_path(key)
    if not path.is_file():
        return None
    try:
        tune = BackendTune.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("Ignoring the backend tune %s (%s: %s); run `kvloom backends tune` again", path,
                       type(exc).__name__, exc)  # fmt: skip
        return None
    if tune.key != key:
        logger.warning("Ignoring the backend tune %s: it was made for %s, not %s", path, tune.key, key)
        return None
    return tune


def find_tune(platform: type[Platform], config: AttentionSelectorConfig) -> BackendTune | None:
    """The cached tune that applies to ``config`` on ``platform`` here, if any."""
    key = TuneKey.of(platform, config)
    return load_tune(key) if key is not None else None


def run_tune(
    key: TuneKey,
    config: AttentionSelectorConfig,
    backends: Sequence[type[AttentionBackend]],
    time_step: StepTimer,
    num_layers: int,
    model: str = "",
    cases: Sequence[StepCase] = STEP_CASES,
) -> BackendTune:
    """Time every case for each of ``backends`` (the valid candidates, each at the block
    size it would run with: ``config.block_size`` or its preferred one). A backend whose
    timing raises is recorded with the error (it stays behind the measured ones)."""
    import dataclasses

    results = []
    for backend in backends:
        block_size = config.block_size if config.block_size is not None else backend.preferred_block_size()
        times = BackendTimes(backend.NAME, block_size)
        backend_config = dataclasses.replace(config, block_size=block_size)
        try:
            for case in cases:
                times.times_ms[case.name] = float(time_step(backend, backend_config, case, num_layers))
        except Exception as exc:  # one backend's failure is its row's, not the tune's
            logger.warning("Backend %s could not be timed: %s: %s", backend.NAME, type(exc).__name__, exc)
            times.error = f"{type(exc).__name__}: {exc}"
        results.append(times)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return BackendTune(key=key, backends=results, num_layers=num_layers, created=created, model=model)
