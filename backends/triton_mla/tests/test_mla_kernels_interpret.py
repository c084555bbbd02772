"""The MLA Triton kernels on the CPU, in Triton's interpreter, against float64 references.

``TRITON_INTERPRET=1`` must be set before the kernels are defined and stays process-wide, so
the kernels run in one child process (this file with ``--worker``), never in the pytest
process; the child runs every case once and prints one JSON line, each case is then its own
test here. bf16 is not run in the interpreter (its ``tl.dot`` on bf16 multiplies the raw
bits); the GPU tests cover bf16.

Decode cases: fresh random latent caches over shuffled blocks (NaN wherever no request has
a position), ragged sequence lengths, block sizes that are and are not multiples of the
position tile, 1 and several KV splits, head counts below and above one head tile.
Prefill cases: causal varlen attention with qk dim != v dim, with and without a cached
prefix (more keys than queries). Backend cases: TRITON_MLA through the MLA contract
(builder + impl) next to CPU_MLA, and the MLA conformance kit's cases at small dims.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOLERANCE = {"float32": 1e-5, "float16": 5e-3}


@dataclass(frozen=True)
class DecodeSpec:
    name: str
    seq_lens: tuple[int, ...]
    num_heads: int
    block_size: int
    num_splits: int
    dtype: str = "float32"
    kv_lora_rank: int = 32
    rope_dim: int = 16
    config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillSpec:
    name: str
    query_lens: tuple[int, ...]
    key_lens: tuple[int, ...]
    num_heads: int = 2
    qk_dim: int = 48
    v_dim: int = 32
    dtype: str = "float32"


SMALL = {"decode_block_n": 16}

DECODE = [
    DecodeSpec("one_split_block16", (1, 17, 40, 70), 4, 16, 1, config=SMALL),
    DecodeSpec("one_split_block5", (3, 33, 64), 4, 5, 1, config=SMALL),
    DecodeSpec("splits3_block16", (1, 17, 40, 70), 4, 16, 3, config=SMALL),
    DecodeSpec("splits4_block32_tile32", (9, 100, 129), 8, 32, 4, config={"decode_block_n": 32}),
    DecodeSpec("splits7_block1", (2, 30, 61), 4, 1, 7, config=SMALL),
    # More splits than a short request has tiles: its trailing splits are empty (lse -inf).
    DecodeSpec("splits6_short_requests", (1, 2, 90), 4, 16, 6, config=SMALL),
    # 20 heads with 16-head tiles: two head tiles, the second one partly masked.
    DecodeSpec("heads20_two_tiles", (12, 50), 20, 16, 2, config=SMALL),
    DecodeSpec("rank48_rope8_unpadded", (7, 45), 3, 8, 2, kv_lora_rank=48, rope_dim=8, config=SMALL),
    DecodeSpec("fp16_splits5_block16", (1, 17, 99), 4, 16, 5, dtype="float16", config=SMALL),
    DecodeSpec("fp16_one_split_block64", (65, 130), 8, 64, 1, dtype="float16", config={"decode_block_n": 32}),
]

PREFILL = [
    PrefillSpec("no_prefix", (7, 20, 1), (7, 20, 1)),
    PrefillSpec("cached_prefix", (5, 16, 1), (30, 16, 41)),
    PrefillSpec("dims_192_128", (9, 3), (9, 40), num_heads=2, qk_dim=192, v_dim=128),
    PrefillSpec("fp16_prefix", (33, 4), (50, 4), dtype="float16"),
]


def _run_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from kvloom_backend_triton.interpreter_compat import patch_interpreter_scalar_index
    from kvloom_backend_triton_mla import ops

    from kvloom.testing.mla_decode import make_decode_case
    from kvloom.testing.reference import attend, relative_error

    patch_interpreter_scalar_index()
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for index, spec in enumerate(DECODE):
        try:
            dtype = getattr(torch, spec.dtype)
            case = make_decode_case(list(spec.seq_lens), num_heads=spec.num_heads, kv_lora_rank=spec.kv_lora_rank,
                                    rope_dim=spec.rope_dim, block_size=spec.block_size, dtype=dtype, seed=100 + index)
            out = torch.full((len(spec.seq_lens), spec.num_heads, spec.kv_lora_rank), float("nan"), dtype=dtype)
            cfg = ops.resolve_config(dtype, spec.config)
            L = spec.kv_lora_rank
            ops.mla_decode(case.q[..., :L], case.q[..., L:], case.kv_cache, case.block_table, case.seq_lens, out,
                           case.scale, spec.num_splits, cfg)
            results[spec.name] = {"rel_error": relative_error(out, case.reference())}
        except Exception as exc:  # reported per case by the parent
            results[spec.name] = {"error": f"{type(exc).__name__}: {exc}"}

    for index, spec in enumerate(PREFILL):
        try:
            dtype = getattr(torch, spec.dtype)
            gen = torch.Generator().manual_seed(200 + index)
            nq, nk = sum(spec.query_lens), sum(spec.key_lens)
            q = torch.randn(nq, spec.num_heads, spec.qk_dim, generator=gen).to(dtype)
            k = torch.randn(nk, spec.num_heads, spec.qk_dim, generator=gen).to(dtype)
            v = torch.randn(nk, spec.num_heads, spec.v_dim, generator=gen).to(dtype)
            cu_q = torch.tensor([0, *torch.tensor(spec.query_lens).cumsum(0).tolist()], dtype=torch.int32)
            cu_k = torch.tensor([0, *torch.tensor(spec.key_lens).cumsum(0).tolist()], dtype=torch.int32)
            out = torch.full((nq, spec.num_heads, spec.v_dim), float("nan"), dtype=dtype)
            scale = spec.qk_dim**-0.5
            ops.varlen_causal_attention(q, k, v, out, cu_q, cu_k, max(spec.query_lens), scale,
                                        ops.resolve_config(dtype, {"prefill_block_m": 16, "prefill_block_n": 16}))
            ref = torch.cat([
                attend(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], scale)
                for b in range(len(spec.query_lens))
            ])
            results[spec.name] = {"rel_error": relative_error(out, ref)}
        except Exception as exc:
            results[spec.name] = {"error": f"{type(exc).__name__}: {exc}"}
    results.update(_backend_cases())
    results.update(_conformance_cases())
    print("RESULTS " + json.dumps(results))


#: The MLA conformance kit's cases at small dims (the interpreter is too slow for DeepSeek's
#: 16 x (512 + 64); the GPU run uses those: tests/gpu/test_conformance_gpu.py).
SMALL_DIMS = dict(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
#: Decode block sizes of the kit for a MultipleOf(1) backend, minus the two largest (512
#: and 256 would cost the interpreter minutes; the GPU run covers them), plus 5.
INTERPRET_BLOCK_SIZES = [1, 2, 5, 16]


def _conformance_specs() -> list[tuple[str, str, int]]:
    """(scenario, dtype, block size) of the kit's cases run here: every scenario at fp32
    and fp16 (bf16 is not run in the interpreter), the decode at every block size above."""
    import torch
    from kvloom_backend_triton_mla.backend import TritonMLABackend

    from kvloom.testing.conformance import mla_conformance_cases

    cases = mla_conformance_cases(TritonMLABackend, INTERPRET_BLOCK_SIZES)
    return [(c.scenario, str(c.dtype).removeprefix("torch."), c.block_size) for c in cases
            if c.dtype != torch.bfloat16]


def _conformance_cases() -> dict[str, dict]:
    import dataclasses

    import torch
    from kvloom_backend_triton_mla.backend import TritonMLABackend

    from kvloom.interfaces import MLADims
    from kvloom.testing.conformance import mla_conformance_cases
    from kvloom.testing.conformance.mla import run_mla_case

    results: dict[str, dict] = {}
    dims = MLADims(**SMALL_DIMS)
    for case in mla_conformance_cases(TritonMLABackend, INTERPRET_BLOCK_SIZES):
        if case.dtype == torch.bfloat16:
            continue
        case = dataclasses.replace(case, dims=dims)
        key = f"conformance:{case.scenario}:{str(case.dtype).removeprefix('torch.')}:{case.block_size}"
        try:
            # run_mla_case directly: run_conformance would skip a cuda-only backend on the CPU.
            outcome = run_mla_case(TritonMLABackend, case, torch.device("cpu"), seed=17)
            results[key] = {"rel_error": outcome.worst, "problems": outcome.problems, "where": outcome.worst_where}
        except Exception as exc:
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def _mla_spec(phase: str, dtype, **extra):  # type: ignore[no-untyped-def]
    import torch

    from kvloom.interfaces import AttentionLayerSpec, MLADims

    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
    decode = phase == "decode"
    return AttentionLayerSpec(
        num_heads=4, num_kv_heads=1 if decode else 4, head_size=dims.latent_size if decode else dims.qk_head_dim,
        dtype=dtype, kv_cache_dtype=dtype, block_size=16, max_num_seqs=8, max_model_len=256,
        scale=dims.qk_head_dim**-0.5, extra={**dims.to_extra(), "mla_phase": phase, **extra},
    ), dims, torch


def _common(query_lens, seq_lens, block_table, device="cpu"):  # type: ignore[no-untyped-def]
    import torch

    from kvloom.interfaces import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=lens.to(device), block_table=block_table,
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=device), num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    )


def _backend_cases() -> dict[str, dict]:
    """TRITON_MLA through the MLA contract (builder + impl), next to CPU_MLA (the CI
    reference backend) and the float64 reference, on the same inputs."""
    import torch
    from kvloom_backend_cpu.mla import CPUMLABackend
    from kvloom_backend_triton_mla.backend import TritonMLABackend
    from kvloom_backend_triton_mla.builder import CONFIG_EXTRA_KEY, NUM_SMS_EXTRA_KEY

    from kvloom.testing.mla_decode import make_decode_case
    from kvloom.testing.reference import attend, relative_error

    results: dict[str, dict] = {}
    extra = {CONFIG_EXTRA_KEY: {"decode_block_n": 16, "min_split_tokens": 16, "prefill_block_m": 16,
                                "prefill_block_n": 16}, NUM_SMS_EXTRA_KEY: 8}
    for name, seq_lens, pad, graph in (("backend_decode", [1, 20, 77], 0, False),
                                       ("backend_graph_decode_padded", [5, 60, 130], 2, True)):
        try:
            spec, dims, _ = _mla_spec("decode", torch.float32, **extra)
            case = make_decode_case(seq_lens, num_heads=4, kv_lora_rank=32, rope_dim=16, block_size=16,
                                    dtype=torch.float32, seed=len(name))
            bt = torch.cat([case.block_table, case.block_table[:1].expand(pad, -1)])
            lens = [*seq_lens, *([1] * pad)]  # CUDA-graph fillers: one position each
            common = _common([1] * len(lens), lens, bt)
            q = torch.cat([case.q, case.q[:1].expand(pad, -1, -1)])
            outs = {}
            for backend in (TritonMLABackend, CPUMLABackend):
                builder = backend.get_builder_cls()(spec, torch.device("cpu"), bt.shape[1])
                md = builder.build_for_cudagraph_capture(common) if graph else builder.build(common)
                impl = backend.get_impl_cls()(dims, spec.scale)
                out = torch.full((len(lens), 4, 32), float("nan"))
                impl.forward_decode(q, case.kv_cache, md, out)
                outs[backend.NAME] = out[: len(seq_lens)]
                if backend is TritonMLABackend:
                    splits = md.num_kv_splits
            case.scale = spec.scale
            ref = case.reference()
            results[name] = {"rel_error": relative_error(outs["TRITON_MLA"], ref),
                             "vs_cpu_mla": relative_error(outs["TRITON_MLA"], outs["CPU_MLA"]), "num_splits": splits}
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    try:  # requests within min_split_tokens: one split eagerly, several planned in a CUDA graph
        spec, dims, _ = _mla_spec("decode", torch.float32, **{
            CONFIG_EXTRA_KEY: {"decode_block_n": 16, "min_split_tokens": 64}, NUM_SMS_EXTRA_KEY: 8})
        case = make_decode_case([20, 45, 64], num_heads=4, kv_lora_rank=32, rope_dim=16, block_size=16,
                                dtype=torch.float32, seed=3)
        common = _common([1, 1, 1], [20, 45, 64], case.block_table)
        builder = TritonMLABackend.get_builder_cls()(spec, torch.device("cpu"), case.block_table.shape[1])
        impl = TritonMLABackend.get_impl_cls()(dims, spec.scale)
        outs, splits = [], []
        for md in (builder.build(common), builder.build_for_cudagraph_capture(common)):
            out = torch.full((3, 4, 32), float("nan"))
            impl.forward_decode(case.q, case.kv_cache, md, out)
            outs.append(out)
            splits.append(md.num_kv_splits)
        results["backend_graph_plan_same_bits"] = {"splits": splits, "same_bits": torch.equal(*outs),
                                                   "finite": bool(outs[0].isfinite().all())}
    except Exception as exc:
        results["backend_graph_plan_same_bits"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        spec, dims, _ = _mla_spec("prefill", torch.float32, **extra)
        gen = torch.Generator().manual_seed(5)
        query_lens, seq_lens = [6, 1, 19], [30, 1, 19]  # cached prefix, a one-token prefill, none
        nq, nk = sum(query_lens), sum(seq_lens)
        q = torch.randn(nq, 4, 32, generator=gen)
        k = torch.randn(nk, 4, 32, generator=gen)
        v = torch.randn(nk, 4, 24, generator=gen)
        common = _common(query_lens, seq_lens, torch.zeros(3, 2, dtype=torch.int32))
        outs = {}
        for backend in (TritonMLABackend, CPUMLABackend):
            md = backend.get_builder_cls()(spec, torch.device("cpu"), 2).build(common)
            out = torch.full((nq, 4, 24), float("nan"))
            backend.get_impl_cls()(dims, spec.scale).forward_prefill(q, k, v, md, out)
            outs[backend.NAME] = out
        cq = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
        ck = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
        ref = torch.cat([attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], spec.scale)
                         for i in range(3)])
        results["backend_prefill"] = {"rel_error": relative_error(outs["TRITON_MLA"], ref),
                                      "vs_cpu_mla": relative_error(outs["TRITON_MLA"], outs["CPU_MLA"])}
    except Exception as exc:
        results["backend_prefill"] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, timeout=900,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("spec", DECODE, ids=[s.name for s in DECODE])
def test_decode_matches_float64_reference(interpreter_results: dict, spec: DecodeSpec) -> None:
    result = interpreter_results[spec.name]
    assert "error" not in result, result.get("error")
    assert result["rel_error"] < TOLERANCE[spec.dtype], f"{spec.name}: rel error {result['rel_error']:.3e}"


@pytest.mark.parametrize("spec", PREFILL, ids=[s.name for s in PREFILL])
def test_prefill_matches_float64_reference(interpreter_results: dict, spec: PrefillSpec) -> None:
    result = interpreter_results[spec.name]
    assert "error" not in result, result.get("error")
    assert result["rel_error"] < TOLERANCE[spec.dtype], f"{spec.name}: rel error {result['rel_error']:.3e}"


@pytest.mark.parametrize("name", ["backend_decode", "backend_graph_decode_padded", "backend_prefill"])
def test_backend_matches_reference_and_cpu_mla(interpreter_results: dict, name: str) -> None:
    result = interpreter_results[name]
    assert "error" not in result, result.get("error")
    assert result["rel_error"] < TOLERANCE["float32"], f"{name}: rel error {result['rel_error']:.3e}"
    assert result["vs_cpu_mla"] < TOLERANCE["float32"], f"{name}: differs from CPU_MLA by {result['vs_cpu_mla']:.3e}"
    if "decode" in name:
        assert result["num_splits"] > 1  # the split path and its reduce ran


def test_short_requests_same_bits_in_eager_and_graph_plans(interpreter_results: dict) -> None:
    """A CUDA graph plans the decode splits for ``max_model_len``, an eager step for its
    longest sequence; requests within ``min_split_tokens`` still come out bit for bit the
    same (the kernel keeps each in one slice), so CUDA graphs do not change the tokens."""
    result = interpreter_results["backend_graph_plan_same_bits"]
    assert "error" not in result, result.get("error")
    eager_splits, graph_splits = result["splits"]
    assert eager_splits == 1 and graph_splits > 1  # the plans do differ
    assert result["finite"]
    assert result["same_bits"]


@pytest.mark.parametrize("scenario,dtype,block_size", _conformance_specs(), ids=lambda v: str(v))
def test_mla_conformance_cases(interpreter_results: dict, scenario: str, dtype: str, block_size: int) -> None:
    """The MLA conformance kit's cases (kvloom.testing.conformance.mla) on TRITON_MLA:
    latent write with padding, decode over paged latent rows (every block size here, long
    contexts through the split path), prefill, chunked prefill over a cached prefix."""
    import torch

    from kvloom.testing.conformance.report import DEFAULT_TOLERANCES

    result = interpreter_results[f"conformance:{scenario}:{dtype}:{block_size}"]
    assert "error" not in result, result.get("error")
    assert not result["problems"], result["problems"]
    tol = DEFAULT_TOLERANCES[getattr(torch, dtype)]
    assert result["rel_error"] <= tol, f"rel error {result['rel_error']:.3e} > {tol:.0e} at {result['where']}"


def test_benchmark_script_runs_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_mla_decode.py at a tiny shape in the interpreter (splits forced on),
    so the GPU run cannot fail on a script error."""
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_mla_decode.py"), "--device", "cpu", "--dtype", "float16",
         "--batches", "1,2", "--contexts", "40", "--num-heads", "4", "--kv-lora-rank", "32", "--rope-dim", "16",
         "--block-size", "16", "--variants", "decode_block_n=16,min_split_tokens=16;decode_block_n=32", "--kernels",
         "TRITON_MLA,FLASHINFER_MLA", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((tmp_path / "mla_decode.json").read_text())
    triton_rows = [r for r in result["rows"] if r["kernel"] == "TRITON_MLA"]
    assert [(r["batch"], r["context"], r["variant"]) for r in triton_rows] == [
        (1, 40, "decode_block_n=16,min_split_tokens=16"), (1, 40, "decode_block_n=32"),
        (2, 40, "decode_block_n=16,min_split_tokens=16"), (2, 40, "decode_block_n=32")]
    for row in triton_rows:
        assert row["rel_error"] < TOLERANCE["float16"] and row["ms"] > 0 and row["latent_bytes"] > 0
    assert triton_rows[0]["num_kv_splits"] > 1
    # FlashInfer is not installed on the CPU: its rows say so instead of failing the run.
    assert all("error" in r for r in result["rows"] if r["kernel"] == "FLASHINFER_MLA")


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
