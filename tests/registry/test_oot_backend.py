"""The out-of-tree test backend (tests/plugins/oot_backend) computes correct attention.

The install tests use it as a real backend; here it is imported straight from its
source directory (no entry points involved) and compared with the float64 reference of
``kvloom.testing.reference`` on fresh random paged data: a prefill continuing a cached
prefix, a decode step and a fresh prefill in one batch, GQA, a padded token whose slot is -1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvloom.testing.reference import check_paged_case, make_paged_case, run_paged_case

SOURCE = Path(__file__).resolve().parents[1] / "plugins" / "oot_backend"


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> type:
    monkeypatch.syspath_prepend(str(SOURCE))
    from kvloom_test_oot_backend.backend import OotTestAttentionBackend

    return OotTestAttentionBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_against_float64_reference(backend: type, dtype: torch.dtype) -> None:
    # (cached context tokens, new tokens) per request: chunked prefill, decode, fresh prefill
    shapes = [(11, 6), (20, 1), (0, 9)]
    case = make_paged_case(
        backend, [new for _, new in shapes], [context + new for context, new in shapes], num_heads=4,
        num_kv_heads=2, head_size=64, block_size=8, dtype=dtype, seed=0, max_num_seqs=8, max_model_len=64,
        pad_tokens=1,  # one CUDA-graph style padding token: slot -1, must not be written
    )
    run = run_paged_case(case)
    # The cache exactly: the new tokens' keys and values where the slot mapping says, and
    # nothing else (the padding token skipped); the output written for every real token.
    check = check_paged_case(case, run)
    assert not check.problems, check.problems
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        run.output[: case.num_actual_tokens].double(), case.expected_output, atol=tol, rtol=tol
    )
