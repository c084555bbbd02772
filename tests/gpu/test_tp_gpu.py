"""Tensor parallelism on two CUDA GPUs (NCCL): TP=2 gives TP=1's greedy tokens on the fp32
tiny Llama, Qwen3 and the MoE models (Qwen3-MoE, Mixtral: experts sharded, the Triton
fused_moe on each rank's slices), eager and with the platform's default CUDA graphs; the
same through the Ray executor (a local Ray started by the executor, one GPU per actor;
skipped without ray installed); pipeline parallelism PP=2 (NCCL send/recv between the
stages, two micro-batches in flight) gives PP=1's on Llama and Qwen3-MoE, under ``mp``
and through the Ray executor; a killed rank raises naming it.

Run on a machine with two or more GPUs: ``bash tests/gpu/run.sh tp``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

from kvloom import LLM, SamplingParams  # noqa: E402
from kvloom.executor.multiproc import WorkerRankError  # noqa: E402
from kvloom.testing.models import tiny_model_dir  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = [[3, 17, 250, 9, 41], [5, 6, 7, 100, 200, 300, 11, 12, 13], [400, 2, 77]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def greedy_tokens(model: str, **engine_args: object) -> list[list[int]]:
    llm = LLM(model, dtype="float32", gpu_memory_utilization=0.3, disable_log_stats=True, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_tp2_matches_tp1_on_gpus(arch: str, enforce_eager: bool) -> None:
    model = str(tiny_model_dir(arch))
    expected = greedy_tokens(model, enforce_eager=enforce_eager)
    assert greedy_tokens(model, tensor_parallel_size=2, enforce_eager=enforce_eager) == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_pp2_matches_pp1_on_gpus(arch: str) -> None:
    model = str(tiny_model_dir(arch))
    # More requests than fit one micro-batch (a 16-token step budget): the batch queue fills.
    batching = {"max_num_seqs": 4, "max_num_batched_tokens": 16}
    expected = greedy_tokens(model, enforce_eager=True, **batching)
    assert greedy_tokens(model, pipeline_parallel_size=2, **batching) == expected


def test_killed_rank_raises_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", gpu_memory_utilization=0.3, disable_log_stats=True,
              tensor_parallel_size=2, enforce_eager=True)  # fmt: skip
    pids = llm.llm_engine.engine_core.core.executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerRankError, match="rank 1"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()


def test_tp2_through_ray_matches_tp1_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ray actors of one GPU each (Ray shows each its GPU as cuda:0), NCCL between them."""
    pytest.importorskip("ray")
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    model = str(tiny_model_dir("qwen3_moe"))
    expected = greedy_tokens(model, enforce_eager=True)
    assert greedy_tokens(model, tensor_parallel_size=2, distributed_executor_backend="ray",
                         enforce_eager=True) == expected  # fmt: skip


def test_pp2_through_ray_matches_pp1_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages as Ray actors of one GPU each, NCCL send/recv between them; the output is
    the last stage's."""
    pytest.importorskip("ray")
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    model = str(tiny_model_dir("llama"))
    batching = {"max_num_seqs": 4, "max_num_batched_tokens": 16}
    expected = greedy_tokens(model, enforce_eager=True, **batching)
    assert greedy_tokens(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **batching) == expected
