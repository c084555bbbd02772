"""Results of the conformance suite and the ways to run it: ``run_case`` (one case, a
``CaseResult``), ``run_conformance`` (a backend's suite, a ``ConformanceReport``) and
``check_case`` (the pytest helper). Cases pass when nothing is wrong and the worst relative
error is within the dtype's tolerance."""

from __future__ import annotations

import logging
import os
import secrets
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionSelectorConfig,
    AttentionType,
    dtype_name,
)
from kvloom.platforms.interface import DeviceCapability
from kvloom.testing.conformance.cases import ConformanceCase, conformance_cases, resolve_backend
from kvloom.testing.conformance.mla import MLAConformanceCase, run_mla_case
from kvloom.testing.conformance.runner import case_seed, run_steps

logger = logging.getLogger(__name__)

#: Largest accepted relative error per model dtype (override with ``tolerances=``).
DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 5e-3,
}

SEED_ENV = "KVLOOM_CONFORMANCE_SEED"


@dataclass
class CaseResult:
    """The verdict on one case (``rel_error``: the worst request's, ``None`` when the case
    did not run to the end)."""

    name: str
    params: dict[str, Any]
    rel_error: float | None
    tolerance: float
    passed: bool
    message: str = ""
    skipped: bool = False
    seconds: float = 0.0

    def format(self) -> str:
        if self.skipped:
            return f"SKIP {self.name}: {self.message}"
        err = "n/a" if self.rel_error is None else f"{self.rel_error:.2e}"
        verdict = "PASS" if self.passed else "FAIL"
        line = f"{verdict} {self.name}  rel_err {err} (tol {self.tolerance:.0e}, {self.seconds:.2f}s)"
        return line if self.passed or not self.message else f"{line}\n     {self.message}"


@dataclass
class ConformanceReport:
    """The verdicts on a backend's suite."""

    backend: str
    device: str
    seed: int
    quick: bool
    cases: list[CaseResult] = field(default_factory=list)
    #: Problems that prevented cases from running at all.
    errors: list[str] = field(default_factory=list)

    @property
    def ran(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.skipped]

    @property
    def failed(self) -> list[CaseResult]:
        return [c for c in self.ran if not c.passed]

    @property
    def passed(self) -> bool:
        """All cases that ran passed, at least one ran, and nothing prevented running."""
        return not self.errors and bool(self.ran) and not self.failed

    def format(self) -> str:
        skipped = len(self.cases) - len(self.ran)
        lines = [
            f"Conformance of {self.backend} on {self.device} ({'quick' if self.quick else 'full'} suite, "
            f"seed {self.seed}): {len(self.ran) - len(self.failed)}/{len(self.ran)} passed"
            + (f", {skipped} skipped" if skipped else "")
        ]
        lines += [f"  ERROR {e}" for e in self.errors]
        lines += [f"  {c.format()}" for c in self.cases]
        if not self.ran and not self.errors:
            lines.append("  ERROR no case ran")
        lines.append(f"{'PASSED' if self.passed else 'FAILED'}")
        if not self.passed:
            lines.append(
                f"reproduce: run_conformance({self.backend!r}, device={self.device!r}, "
                f"quick={self.quick}, seed={self.seed})"
            )
        return "\n".join(lines)


def default_seed(seed: int | None) -> int:
    """``seed``; else ``$KVLOOM_CONFORMANCE_SEED`` when set; else a random seed."""
    if seed is not None:
        return seed
    env = os.environ.get(SEED_ENV)
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"{SEED_ENV}={env!r}: expected an integer seed") from None
    return secrets.randbelow(2**31)


def _device_capability(device: torch.device) -> DeviceCapability | None:
    if device.type == "cuda" and torch.cuda.is_available():
        return DeviceCapability(*torch.cuda.get_device_capability(device))
    return None


def _device_problem(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        return f"device {device} is not available in this process"
    return None


def run_case(
    backend: str | type[AttentionBackend],
    case: ConformanceCase | MLAConformanceCase,
    device: str = "cpu",
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
) -> CaseResult:
    """Run one case (standard or MLA); never raises for backend errors (they become a failed result)."""
    cls = resolve_backend(backend)
    dev = torch.device(device)
    seed = default_seed(seed)
    tol = {**DEFAULT_TOLERANCES, **(tolerances or {})}.get(case.dtype)
    if tol is None:
        raise ValueError(
            f"tolerances: no tolerance for dtype {dtype_name(case.dtype)} (pass tolerances={{dtype: tol}})"
        )
    params = {**case.params, "seed": seed}

    def result(**kw: Any) -> CaseResult:
        return CaseResult(name=case.name, params=params, tolerance=tol, **kw)

    problem = _device_problem(dev)
    if problem:
        return result(rel_error=None, passed=False, message=problem)
    if isinstance(case, MLAConformanceCase):
        selector_config = case.selector_config(dev.type, _device_capability(dev))
    else:
        selector_config = AttentionSelectorConfig(
            head_size=case.head_size,
            dtype=case.dtype,
            kv_cache_dtype="auto",
            block_size=case.block_size,
            attn_type=AttentionType.DECODER,
            device_type=dev.type,
            device_capability=_device_capability(dev),
            num_heads=case.num_heads,
            num_kv_heads=case.num_kv_heads,
        )
    reasons = cls.validate_configuration(selector_config)
    if reasons:
        return result(rel_error=None, passed=False, skipped=True, message="; ".join(reasons))

    started = time.perf_counter()
    try:
        if isinstance(case, MLAConformanceCase):
            outcome = run_mla_case(cls, case, dev, case_seed(seed, case))
        else:
            outcome = run_steps(cls, case, dev, case_seed(seed, case))
    except Exception as exc:  # a crashing backend is a failed case, reported with its traceback
        tb = traceback.format_exc(limit=-4).strip().replace("\n", "\n     ")
        return result(rel_error=None, passed=False, message=f"{type(exc).__name__}: {exc}\n     {tb}",
                      seconds=time.perf_counter() - started)
    seconds = time.perf_counter() - started
    problems = outcome.problems
    if not problems and not (outcome.worst <= tol):
        problems.append(f"relative error {outcome.worst:.3e} > tolerance {tol:.0e} (worst: {outcome.worst_where})")
    return result(rel_error=outcome.worst, passed=not problems, message="; ".join(problems), seconds=seconds)


def run_conformance(
    backend: str | type[AttentionBackend],
    device: str = "cpu",
    quick: bool = False,
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
    cases: Sequence[ConformanceCase | MLAConformanceCase] | None = None,
) -> ConformanceReport:
    """Run the suite (or the given ``cases``) against ``backend`` on ``device``.

    ``backend`` is a NAME resolved through ``kvloom.attention.selector.get_attention_backend`` or an
    ``AttentionBackend`` subclass; an MLA backend (``is_mla``) runs the MLA cases
    (``kvloom.testing.conformance.mla``). ``tolerances`` overrides the per-dtype relative-error
    limits of ``DEFAULT_TOLERANCES``.
    """
    seed = default_seed(seed)
    name = backend if isinstance(backend, str) else getattr(backend, "NAME", backend.__name__)
    report = ConformanceReport(backend=name, device=str(device), seed=seed, quick=quick)
    try:
        cls = resolve_backend(backend)
    except Exception as exc:
        report.errors.append(f"cannot load backend {name!r}: {type(exc).__name__}: {exc}")
        return report
    if torch.device(device).type not in cls.supported_device_types:
        report.errors.append(
            f"{name} does not support device type {torch.device(device).type} "
            f"(supports {', '.join(cls.supported_device_types)})"
        )
        return report
    problem = _device_problem(torch.device(device))
    if problem:
        report.errors.append(problem)
        return report
    for case in cases if cases is not None else conformance_cases(cls, device, quick):
        res = run_case(cls, case, device, seed, tolerances)
        logger.debug("%s", res.format())
        report.cases.append(res)
    return report


def check_case(
    backend: str | type[AttentionBackend],
    case: ConformanceCase | MLAConformanceCase,
    device: str = "cpu",
    seed: int | None = None,
    tolerances: Mapping[torch.dtype, float] | None = None,
) -> CaseResult:
    """pytest helper: run one case; skip it when the backend rejects the configuration on
    this device, fail with the case's message and seed when it does not pass."""
    seed = default_seed(seed)
    res = run_case(backend, case, device, seed, tolerances)
    if res.skipped:
        import pytest

        pytest.skip(f"{case.name}: {res.message}")
    if not res.passed:
        raise AssertionError(f"{res.format()}\n     reproduce with {SEED_ENV}={seed}")
    return res
