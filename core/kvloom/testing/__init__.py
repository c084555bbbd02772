"""Testing tools shipped with kvloom: the attention backend conformance suite.

See ``kvloom.testing.conformance`` for the cases and the usage patterns (CLI, Python,
pytest).
"""

from kvloom.testing.conformance import (
    DEFAULT_TOLERANCES,
    CaseResult,
    ConformanceCase,
    ConformanceReport,
    check_case,
    conformance_cases,
    run_case,
    run_conformance,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "CaseResult",
    "ConformanceCase",
    "ConformanceReport",
    "check_case",
    "conformance_cases",
    "run_case",
    "run_conformance",
]
