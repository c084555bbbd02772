"""Pipeline parallelism on the CPU: two gloo ranks (``--pipeline-parallel-size 2``).

* PP=2 generates the same greedy tokens as PP=1 on the fp32 tiny models (Llama, Qwen3
  with an uneven 2+1 layer split, Qwen3-MoE, and Qwen2 with tied embeddings: the last
  stage's own LM head loads the embedding), with more requests than ``max_num_seqs`` and
  a small token budget so that the engine core keeps two micro-batches in flight;
* TP=2 x PP=2 (four ranks) gives the same tokens too, and so does PP=2 under forced
  preemption (a KV cache too small for the batch: requests are preempted, some with a step
  still in the pipeline);
* a stage builds and reads only its own layers (and the embedding / norm / head where
  they live);
* a killed rank makes ``generate`` raise an error naming it, and no process is left;
* bad ``pipeline_parallel_size`` values are refused naming the field.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvloom import LLM, SamplingParams
from kvloom.distributed import parallel_state
from kvloom.distributed.pipeline import PPMissingLayer, stage_layer_range
from kvloom.engine.core import EngineCore
from kvloom.executor.multiproc import MultiprocExecutor, WorkerRankError
from kvloom.loader import weight_utils
from kvloom.loader.model_loader import get_model
from kvloom.testing import resolve_engine_config
from kvloom.testing.models import random_prompts, tiny_model_dir
from tests.helpers.engine_faults import running_pids
from tests.helpers.model_fixtures import greedy_counting_preemptions

# Five requests over max_num_seqs=4 and a 16-token step budget: prompts are chunked, and
# while one micro-batch is in the pipeline the next takes the requests left out of it.
PROMPTS = [[3, 17, 250, 9, 41], [5, 6, 7, 100, 200, 300, 11, 12, 13], [400, 2, 77], [8, 9], [100, 101, 102, 103]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def greedy_tokens(model: str, **engine_args: object) -> tuple[list[list[int]], int]:
    """The greedy tokens of PROMPTS and the most micro-batches the engine core had in flight."""
    llm = LLM(model, dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True, max_num_seqs=4,
              max_num_batched_tokens=16, **engine_args)  # fmt: skip
    core: EngineCore = llm.llm_engine.engine_core.core
    depth = [0]
    launch = core.executor.execute_model

    def spy(scheduler_output: object) -> object:
        pending = launch(scheduler_output)
        depth[0] = max(depth[0], len(core._in_flight) + 1)
        return pending

    core.executor.execute_model = spy  # type: ignore[method-assign]
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], depth[0]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(autouse=True)
def _core_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine core in this process: the test reaches into it, and starts faster.
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3_moe", "qwen2"])
def test_pp2_greedy_tokens_match_pp1(model: str) -> None:
    path = str(tiny_model_dir(model))
    expected, _ = greedy_tokens(path)
    assert len({tuple(t) for t in expected}) > 1  # the prompts do not all collapse to one output
    tokens, depth = greedy_tokens(path, pipeline_parallel_size=2)
    assert tokens == expected
    assert depth == 2  # the batch queue held two micro-batches at once


def test_tp2_times_pp2_greedy_tokens_match() -> None:
    path = str(tiny_model_dir("llama"))
    expected, _ = greedy_tokens(path)
    tokens, _ = greedy_tokens(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert tokens == expected


def test_pp2_under_preemption_matches_pp1() -> None:
    """14 blocks of 16 tokens cannot hold 5 requests of up to 104 tokens (as in
    tests/e2e/test_generate.py's preemption case)."""
    path = str(tiny_model_dir("llama"))
    prompts = random_prompts(512)

    def run(**engine_args: object) -> tuple[list[list[int]], int]:
        llm = LLM(path, dtype="float32", max_model_len=128, disable_log_stats=True, **engine_args)  # type: ignore[arg-type]
        try:
            return greedy_counting_preemptions(llm, prompts, 40)
        finally:
            llm.llm_engine.shutdown()

    expected, _ = run(kv_cache_memory="16MiB")
    tokens, preemptions = run(pipeline_parallel_size=2, num_gpu_blocks_override=14)
    assert preemptions > 0
    assert tokens == expected


def test_stage_layer_ranges() -> None:
    assert [stage_layer_range(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layer_range(4, s, 4) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: 5 stages for 4 layers \(allowed: 1..4\)"):
        stage_layer_range(4, 0, 5)


@pytest.mark.parametrize(("model", "tied"), [("qwen3", False), ("qwen2", True)])
def test_a_stage_builds_and_reads_only_its_part(model: str, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last of two stages: only its layers, the norm and the head (its own copy of a
    tied embedding); the loader never reads the first stage's tensors."""
    config = resolve_engine_config(model=str(tiny_model_dir(model)), dtype="float32")
    layers = config.model.hf_config.num_hidden_layers
    read: list[str] = []
    original = weight_utils.safetensors_weights

    def spy(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for name, tensor in original(*args, **kwargs):  # type: ignore[arg-type]
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(weight_utils, "safetensors_weights", spy)
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state._ParallelState(rank=1, world_size=2, tp_size=1))
    net = get_model(config, "cpu")
    start, end = stage_layer_range(layers, 1, 2)
    assert isinstance(net.model.embed_tokens, PPMissingLayer)
    assert [i for i, layer in enumerate(net.model.layers) if not isinstance(layer, PPMissingLayer)] == list(
        range(start, end)
    )
    assert not any(n.startswith(f"model.layers.{i}.") for n in read for i in range(start))
    assert ("model.embed_tokens.weight" in read) == tied
    assert any(n.startswith("model.norm.") for n in read)
    assert net.lm_head.weight.data_ptr() != 0



@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_raises_naming_it_and_leaves_no_process(victim: int) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              pipeline_parallel_size=2)  # fmt: skip
    executor = llm.llm_engine.engine_core.core.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = executor.worker_pids
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    os.kill(pids[victim], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerRankError, match=rf"rank {victim} .*killed by SIGKILL") as info:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert info.value.rank == victim
    assert time.monotonic() - start < 30  # seen through the process sentinel, not a collective timeout
    llm.llm_engine.shutdown()
    assert running_pids(pids) == []


@pytest.mark.parametrize(
    ("model", "engine_args", "message"),
    [
        ("llama", {"pipeline_parallel_size": 3},
         r"pipeline_parallel_size: 3 stages for the model's 2 layers \(allowed: 1..2"),
        ("llama", {"pipeline_parallel_size": 0}, r"pipeline_parallel_size"),
        ("llama", {"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
         r"distributed_executor_backend: 'uni' runs one worker, but pipeline_parallel_size is 2 \(allowed .*: mp, ray\)"),
        ("llama", {"pipeline_parallel_size": 2, "async_scheduling": True},
         r"async_scheduling: True is not supported with pipeline_parallel_size 2"),
        ("llama", {"pipeline_parallel_size": 2, "torch_compile": True}, r"pipeline_parallel_size: 2 runs eagerly"),
        ("deepseek_v2", {"pipeline_parallel_size": 2},
         r"pipeline_parallel_size: DeepseekV2ForCausalLM \(generate runner\) cannot be split"),
    ],
)  # fmt: skip
def test_bad_pipeline_parallel_size_is_refused_naming_the_field(
    model: str, engine_args: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_engine_config(model=str(tiny_model_dir(model)), **engine_args)


def test_pp_flag_parses() -> None:
    import argparse

    from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace

    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_namespace(parser.parse_args(["--model", "m", "-pp", "2", "-tp", "2"]))
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 2)
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), pipeline_parallel_size=2)
    assert (config.parallel.distributed_executor_backend, config.parallel.world_size) == ("mp", 2)
