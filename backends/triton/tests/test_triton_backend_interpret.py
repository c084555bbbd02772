"""TRITON_ATTN kernels on the CPU, in Triton's interpreter, against a float64 reference.

``TRITON_INTERPRET=1`` must be set before the kernels are defined and stays process-wide,
so the kernels run in one child process (this file with ``--worker``) and never in the
pytest process: other test modules keep compiled-mode Triton. The child runs every case
once and prints one JSON line; each case is then its own test here.

Each case (``kvloom.testing.reference.make_paged_case``): a random paged batch over
shuffled physical blocks, ``query``/``key``/``value`` as views of one fused QKV tensor, a
cache that is NaN outside the batch's context positions, an output poisoned with NaN, and
a check of each request's relative error against the float64 reference plus an exact
check of the cache write (padding slots -1 left untouched). bf16 attention is not run
here: the interpreter's ``tl.dot`` on bf16 is broken (it multiplies the raw bits); the GPU
suite and the benchmark check bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

FP32_TOL = 1e-5
FP16_TOL = 5e-3


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int = 32
    block_size: int = 16
    dtype: str = "float32"
    pad_tokens: int = 0
    pad_reqs: int = 0
    for_cudagraph: bool = False
    max_model_len: int | None = None
    config: dict = field(default_factory=dict)
    num_sms: int = 8
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False

    @property
    def tolerance(self) -> float:
        return FP32_TOL if self.dtype == "float32" else FP16_TOL


SPLIT = {"force_num_splits": 4, "decode_block_n": 16}
SMALL_TILES = {"prefill_block_m": 16, "prefill_block_n": 16}

CASES = [
    # Decode: one query token per request over its cached context.
    Case("decode_mha", (1, 1, 1), (5, 40, 17), 4, 4),
    Case("decode_gqa4", (1, 1, 1, 1), (1, 33, 64, 70), 8, 2),
    Case("decode_gqa8_block32", (1, 1), (50, 97), 8, 1, block_size=32),
    Case("decode_gqa16_mqa", (1, 1), (20, 45), 16, 1),
    Case("decode_gqa3", (1, 1), (19, 40), 6, 2),
    Case("decode_fp16_d80", (1, 1, 1), (7, 60, 31), 4, 2, head_size=80, dtype="float16"),
    # Split-KV decode forced on (tiny splits), so the reduce kernel runs.
    Case("split_decode_mha", (1, 1, 1), (5, 40, 70), 4, 4, config=SPLIT),
    Case("split_decode_gqa4", (1, 1, 1), (16, 47, 100), 8, 2, config=SPLIT),
    Case("split_decode_gqa8_block32", (1, 1), (64, 129), 8, 1, block_size=32, config=SPLIT),
    Case("split_decode_fp16_d64", (1, 1), (33, 90), 4, 1, head_size=64, dtype="float16", config=SPLIT),
    Case("split_decode_many_splits", (1,), (150,), 4, 2, config={"force_num_splits": 9, "decode_block_n": 16}),
    # Split count planned from the SM count (8 SMs here): 1 request x 1 KV head -> splits.
    Case("split_decode_planned", (1,), (300,), 4, 1, config={"min_split_tokens": 32, "decode_block_n": 16}),
    # CUDA-graph padded decode: splits planned from max_model_len, padded requests and
    # tokens carry slot -1 and seq_len 1; splits past short sequences stay empty.
    Case("graph_decode_padded", (1, 1, 1), (3, 40, 77), 8, 2, pad_reqs=2, pad_tokens=0, for_cudagraph=True,
         max_model_len=256, config={"min_split_tokens": 16, "decode_block_n": 16}),
    Case("graph_decode_padded_fp16", (1, 1), (9, 120), 4, 2, dtype="float16", pad_reqs=3, for_cudagraph=True,
         max_model_len=160, config={"min_split_tokens": 32, "decode_block_n": 16}),
    # Prefill without context.
    Case("prefill_mha", (7, 20), (7, 20), 4, 4),
    Case("prefill_gqa4", (13, 40), (13, 40), 8, 2),
    Case("prefill_gqa8", (33,), (33,), 8, 1, config=SMALL_TILES),
    Case("prefill_gqa3", (10, 25), (10, 25), 6, 2),
    Case("prefill_fp16_d96", (18, 5), (18, 5), 4, 2, head_size=96, dtype="float16"),
    Case("prefill_d256", (9,), (9,), 2, 1, head_size=256, config={"prefill_block_m": 16, "prefill_block_n": 16}),
    # Chunked prefill attending to a cached prefix, incl. prefixes not on block borders.
    Case("chunked_mha", (9, 16), (30, 50), 4, 4, config=SMALL_TILES),
    Case("chunked_gqa4_block32", (12, 7), (45, 71), 8, 2, block_size=32),
    Case("chunked_gqa8_tile_gt_page", (20,), (83,), 8, 1, config={"prefill_block_m": 32, "prefill_block_n": 64}),
    Case("chunked_fp16", (17, 3), (60, 19), 8, 2, dtype="float16", config=SMALL_TILES),
    # Mixed batches: prefill chunks, decodes and token padding (slot -1) together.
    Case("mixed_gqa1", (9, 1, 5, 1), (30, 21, 5, 64), 4, 4, pad_tokens=3, config=SMALL_TILES),
    Case("mixed_gqa4", (1, 14, 1, 6), (40, 14, 9, 26), 8, 2, pad_tokens=2),
    Case("mixed_gqa8_block32", (3, 1, 21), (35, 66, 21), 8, 1, block_size=32, pad_tokens=5, config=SMALL_TILES),
    Case("mixed_fp16_d80", (9, 1, 5), (30, 21, 5), 8, 2, head_size=80, dtype="float16", pad_tokens=2),
    # Its decodes split (the decode kernel and its reduction inside a mixed batch).
    Case("mixed_split_decodes", (1, 12, 1, 1), (70, 30, 100, 9), 8, 2, pad_tokens=2, config={**SPLIT, **SMALL_TILES}),
    # Uniform multi-token batch (spec-decode shape) through the CUDA-graph builder path.
    Case("graph_uniform_q3", (3, 3, 3), (10, 35, 3), 8, 2, pad_reqs=1, for_cudagraph=True, max_model_len=64),
    # Attention features (the blocks before a request's window hold NaN): windows shorter
    # and longer than a tile, off block borders, in chunks, decodes (split and not) and
    # mixed batches; sinks (unsplit, split: added in the reduction); soft caps; all three.
    Case("window_prefill", (40, 9), (40, 9), 8, 2, config=SMALL_TILES, sliding_window=21),
    Case("window_chunked", (20, 7), (83, 60), 8, 2, config=SMALL_TILES, sliding_window=37),
    Case("window_decode", (1, 1, 1), (5, 70, 130), 8, 2, sliding_window=37),
    Case("window_split_decode", (1, 1), (100, 161), 4, 1, config=SPLIT, sliding_window=50),
    Case("window_mixed", (9, 1, 12, 1), (70, 21, 90, 64), 8, 2, pad_tokens=2, config={**SPLIT, **SMALL_TILES},
         sliding_window=23),
    Case("window_graph_decode", (1, 1), (9, 120), 4, 2, pad_reqs=2, for_cudagraph=True, max_model_len=160,
         config={"min_split_tokens": 16, "decode_block_n": 16}, sliding_window=33),
    Case("sinks_mixed", (9, 1, 5, 1), (30, 21, 5, 64), 8, 2, pad_tokens=1, config=SMALL_TILES, sinks=True),
    Case("sinks_split_decode", (1, 1, 1), (16, 47, 100), 8, 2, config=SPLIT, sinks=True),
    Case("soft_cap_mixed", (9, 1, 5), (30, 21, 5), 8, 2, config=SMALL_TILES, logits_soft_cap=3.0),
    Case("soft_cap_split_decode", (1, 1), (33, 90), 4, 1, config=SPLIT, logits_soft_cap=3.0),
    Case("window_sinks_soft_cap_mixed", (12, 1, 1), (75, 50, 90), 8, 2, config={**SPLIT, **SMALL_TILES},
         sliding_window=30, logits_soft_cap=5.0, sinks=True),
    Case("window_sinks_fp16", (9, 1), (66, 80), 4, 2, dtype="float16", sliding_window=40, sinks=True),
]


def _run_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from kvloom_backend_triton.backend import TritonAttentionBackend
    from kvloom_backend_triton.builder import CONFIG_EXTRA_KEY, NUM_SMS_EXTRA_KEY
    from kvloom_backend_triton.interpreter_compat import patch_interpreter_scalar_index

    from kvloom.testing.reference import check_paged_case, make_paged_case, run_paged_case

    patch_interpreter_scalar_index()
    torch.set_num_threads(1)
    results = {}
    for index, case in enumerate(CASES):
        try:
            paged = make_paged_case(
                TritonAttentionBackend, case.query_lens, case.seq_lens,
                num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
                block_size=case.block_size, dtype=getattr(torch, case.dtype), seed=1000 + index,
                pad_tokens=case.pad_tokens, pad_reqs=case.pad_reqs, max_model_len=case.max_model_len,
                extra={CONFIG_EXTRA_KEY: case.config, NUM_SMS_EXTRA_KEY: case.num_sms},
                sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap, sinks=case.sinks,
            )
            run = run_paged_case(paged, for_cudagraph=case.for_cudagraph)
            check = check_paged_case(paged, run)
            results[case.name] = {"rel_error": check.rel_error, "problems": check.problems,
                                  "num_splits": run.metadata.num_splits, "decode_only": run.metadata.decode_only,
                                  "split_single": run.metadata.split_single}
        except Exception as exc:  # reported per case by the parent
            results[case.name] = {"error": f"{type(exc).__name__}: {exc}"}

    # Requests no longer than min_split_tokens: unsplit in an eager step (planned from the
    # step's longest), in several planned splits in a CUDA graph (planned from
    # max_model_len). The kernel keeps each in one run, so both outputs are the same bits.
    paged = make_paged_case(
        TritonAttentionBackend, (1, 1, 1), (20, 45, 64), num_heads=4, num_kv_heads=2, head_size=32,
        block_size=16, dtype=torch.float32, seed=11, max_model_len=1024,
        extra={CONFIG_EXTRA_KEY: {"min_split_tokens": 64, "decode_block_n": 16}, NUM_SMS_EXTRA_KEY: 8},
    )
    eager, graph = run_paged_case(paged), run_paged_case(paged, for_cudagraph=True)
    results["graph_plan_same_bits"] = {
        "eager_splits": eager.metadata.num_splits, "graph_splits": graph.metadata.num_splits,
        "same_bits": torch.equal(eager.output, graph.output),
        "problems": check_paged_case(paged, graph).problems,
    }

    # bf16 through the cache-write kernel alone (a copy: exact, no tl.dot involved).
    from kvloom_backend_triton import ops

    paged = make_paged_case(
        TritonAttentionBackend, (3, 1), (20, 9), num_heads=4, num_kv_heads=2, head_size=48, block_size=16,
        dtype=torch.bfloat16, pad_tokens=2, seed=7,
    )
    key_cache, value_cache = TritonAttentionBackend.split_kv_cache(paged.kv_cache)
    ops.write_kv_cache(paged.key, paged.value, key_cache, value_cache, paged.common.slot_mapping)
    results["bf16_cache_write"] = {"problems": paged.cache_problems()}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker"], capture_output=True, text=True, timeout=900, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_float64_reference(interpreter_results: dict, case: Case) -> None:
    result = interpreter_results[case.name]
    assert "error" not in result, result.get("error")
    assert not result["problems"], result["problems"]  # cache write, unwritten output rows, return value
    assert result["rel_error"] < case.tolerance, f"{case.name}: rel error {result['rel_error']:.3e}"
    assert result["decode_only"] == (max(case.query_lens) == 1)
    # A mixed batch's single-token requests run through the decode kernel (a graph's plan
    # assumes any request may be one).
    mixed = max(case.query_lens) > 1 and (1 in case.query_lens or case.for_cudagraph)
    assert result["split_single"] == mixed


def test_split_cases_really_split(interpreter_results: dict) -> None:
    for case in CASES:
        if case.name.startswith(("split_decode", "graph_decode", "mixed_split", "window_split", "sinks_split",
                                 "soft_cap_split")):
            assert interpreter_results[case.name]["num_splits"] > 1, case.name


def test_short_requests_same_bits_in_eager_and_graph_plans(interpreter_results: dict) -> None:
    """A CUDA graph plans the decode splits for ``max_model_len``, an eager step for its
    longest sequence; requests within ``min_split_tokens`` still come out bit for bit the
    same, so CUDA graphs do not change greedy tokens (tests/gpu/test_e2e_gpu.py, bf16)."""
    result = interpreter_results["graph_plan_same_bits"]
    assert "error" not in result, result.get("error")
    assert result["eager_splits"] == 1 and result["graph_splits"] > 1  # the plans do differ
    assert not result["problems"], result["problems"]
    assert result["same_bits"]


def test_bf16_cache_write_exact(interpreter_results: dict) -> None:
    assert not interpreter_results["bf16_cache_write"]["problems"]


def _run_benchmark(script: str, *args: str) -> None:
    """Run ``benchmarks/<script>`` on the CPU (``--device cpu``, the Triton interpreter)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", script), "--device", "cpu", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def test_benchmark_script_runs_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_attention_kernels.py at tiny shapes on the CPU (interpreter), so
    the GPU run cannot fail on a script error: correctness slice, timing, variants, output."""
    _run_benchmark(
        "bench_attention_kernels.py", "--dtype", "float16", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-size", "32", "--decode-batch", "2", "--decode-context", "40", "--prefill-batch", "1",
        "--prefill-len", "32", "--copy-gib", "0.001", "--gemm-n", "64",
        "--variants", "default;force_num_splits=2,decode_block_n=16", "--out", str(tmp_path),
    )
    result = json.loads((tmp_path / "attention_kernels.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["default", "force_num_splits=2,decode_block_n=16"]
    for row in result["rows"]:
        assert "error" not in row, row["error"]
        assert set(row["rel_errors"]) == {"decode", "prefill", "chunked", "mixed"}
        assert max(row["rel_errors"].values()) < FP16_TOL
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0
    assert "| TRITON_ATTN | default |" in (tmp_path / "attention_kernels.md").read_text()


def test_step_benchmark_script_runs_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_attention_steps.py at tiny shapes on the CPU (interpreter): every
    case of every variant is timed and the mixed rows carry their decomposition."""
    _run_benchmark(
        "bench_attention_steps.py", "--dtype", "float16", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-size", "32", "--context", "40", "--max-model-len", "64", "--decode-batches", "2", "--decodes", "3",
        "--chunk", "16", "--prefixes", "0,20", "--copy-gib", "0.001", "--gemm-n", "64", "--warmup-ms", "1",
        "--rep-ms", "1", "--variants", "default;force_num_splits=2,decode_block_n=16", "--out", str(tmp_path),
    )
    rows = json.loads((tmp_path / "attention_steps.json").read_text())["rows"]
    cases = ["decode 2", "decodes 3 alone", "chunk alone P=0", "mixed P=0", "chunk alone P=20", "mixed P=20"]
    assert [r["case"] for r in rows] == cases * 2
    assert all(r["ms"] > 0 for r in rows)
    assert all({"decodes_alone_ms", "chunk_alone_ms", "extra_us"} <= set(r) for r in rows if r["kind"] == "mixed")


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
