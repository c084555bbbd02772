"""Testing tools shipped with kvloom.

- ``kvloom.testing.conformance``: the attention backend conformance suite (cases and usage
  patterns: CLI, Python, pytest); its public names are re-exported here.
- ``kvloom.testing.reference``: the float64 reference attention over the paged layout and
  the random paged batches that tests and benchmarks check backends with.
- ``kvloom.testing.host_sync``: detect host synchronisations in code meant for CUDA graphs.
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
