"""The attention backend conformance suite.

Every attention backend, ours and third parties', proves itself with the same cases: the
KV-cache write through the slot mapping, prefill, chunked prefill over a cached prefix,
decode, mixed batches of prefill chunks and decodes, padded batches, GQA/MQA ratios, and
every dtype, head size and block size the backend declares. Each case runs the backend's
own metadata builder and ``AttentionImpl.forward`` on fresh random paged data and compares

- the attention output of every real token with a float64 reference computed on the CPU
  (relative error ``||out - ref|| / ||ref||`` per request; the case reports the largest),
  after poisoning the output with NaN so that rows the backend never wrote are caught;
- the whole KV cache, read back through ``backend.split_kv_cache``, exactly against the
  expected cache: every real token's K/V at its slot, nothing else changed (slot ``-1``
  rows, the padding, must not be written).

Inputs follow the contract of ``kvloom.attention.backend``: ``query``/``key``/``value`` are
views of one fused QKV tensor (as models pass them), block tables are shuffled and
non-contiguous, block-table entries past a request's last block hold arbitrary *valid*
block ids, cache slots nobody wrote hold large random values (so reading past
``seq_len`` shows), and the softmax scale is not ``1/sqrt(head_size)`` in every case.

Command line (the CLI calls ``run_conformance`` and prints ``report.format()``)::

    [KVLOOM_CONFORMANCE_SEED=N] kvloom backends test MY_BACKEND [--device cuda] [--quick]

Python::

    from kvloom.testing import run_conformance
    report = run_conformance("MY_BACKEND", device="cuda", quick=True)
    print(report.format())
    assert report.passed

pytest, the recommended pattern for a backend package's own tests (one test per case, so
a failure names its case; the message carries the seed to reproduce it)::

    import pytest
    from kvloom.testing import check_case, conformance_cases
    from my_backend import MyBackend

    @pytest.mark.parametrize("case", conformance_cases(MyBackend, device="cuda"), ids=str)
    def test_conformance(case):
        check_case(MyBackend, case, device="cuda")

Seeds: ``seed=None`` takes ``$KVLOOM_CONFORMANCE_SEED`` when set, else a random seed. Each
case draws its data from (seed, case name), so rerunning one case with the printed seed
reproduces it exactly.

MLA backends (``is_mla``) run the MLA cases instead (``mla``: the latent-cache write,
absorbed decode over paged latent rows at every declared block size, long decodes,
prefill and chunked prefill over a cached prefix, DeepSeek's dims, float64 reference);
``kvloom backends test CPU_MLA`` works as for any backend.

Modules: ``cases`` (the catalogue), ``mla`` (the MLA cases and their runs), ``outcome`` (what a run found), ``plan`` (each case's random steps), ``runner`` (running
a case on the backend), ``report`` (results, ``run_case``/``run_conformance``/``check_case``).
The paged batches and the float64 reference are ``kvloom.testing.reference``'s.
"""

from kvloom.testing.conformance.cases import (
    BASE_LAYOUT,
    HEAD_LAYOUTS,
    SCENARIOS,
    ConformanceCase,
    conformance_cases,
    resolve_backend,
)
from kvloom.testing.conformance.mla import MLA_SCENARIOS, MLAConformanceCase, mla_conformance_cases
from kvloom.testing.conformance.report import (
    DEFAULT_TOLERANCES,
    SEED_ENV,
    CaseResult,
    ConformanceReport,
    check_case,
    run_case,
    run_conformance,
)

__all__ = [
    "BASE_LAYOUT",
    "DEFAULT_TOLERANCES",
    "HEAD_LAYOUTS",
    "MLA_SCENARIOS",
    "MLAConformanceCase",
    "SCENARIOS",
    "SEED_ENV",
    "CaseResult",
    "ConformanceCase",
    "ConformanceReport",
    "check_case",
    "conformance_cases",
    "mla_conformance_cases",
    "resolve_backend",
    "run_case",
    "run_conformance",
]
