"""The engine core in its own process (EngineCoreProc, SyncMPClient, AsyncMPClient):
startup failures reported with their cause, utilities (LoRA, prefix cache) across the
process boundary, an engine core that exits with its parent, and
KVLOOM_ENABLE_MULTIPROCESSING=0 (the core in this process). A failed step:
tests/engine/test_async_llm.py; the server's faults:
tests/entrypoints/openai/test_engine_process.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvloom import LLM, SamplingParams
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.async_llm import AsyncLLM
from kvloom.engine.core_client import (
    AsyncMPClient,
    InprocClient,
    SyncMPClient,
    ThreadedClient,
    multiprocessing_enabled,
)
from kvloom.engine.core_lifecycle import ClientAddresses, EngineCoreProcessHandle, notify_engine_death
from kvloom.engine.errors import EngineDeadError
from kvloom.lora.request import LoRARequest
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.sampling_params import RequestOutputKind
from tests.helpers.engine_faults import (
    ExitsAtStartupPlatform,
    is_running,
    wait_gone,
    with_platform,
)
from tests.helpers.lora_fixtures import make_adapter
from tests.helpers.model_fixtures import random_prompts, tiny_model_dir

PROMPT = random_prompts(320)[2]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_model_dir("llama"))


def engine_args(model_dir: str, **kwargs: Any) -> EngineArgs:
    return EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True, **kwargs)


def engine_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvloom-engine-core")]


# ----------------------------------------------------------------- startup


def test_startup_failure_in_the_engine_core_names_its_cause(model_dir: str) -> None:
    # 4 blocks of 16 tokens cannot hold one request of max_model_len 256: EngineCore raises.
    with pytest.raises(ValueError, match=r"Engine core failed to start: ValueError: The KV cache holds 4 blocks") as e:
        LLM(model_dir, dtype="float32", num_gpu_blocks_override=4, max_model_len=256, block_size=16)
    assert "Traceback" in str(e.value.__cause__)  # the engine core's own traceback
    assert not engine_processes()


def test_missing_weights_are_reported_by_the_engine_core(model_dir: str, tmp_path: Path) -> None:
    broken = tmp_path / "model"
    broken.mkdir()
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    # The weights are read in the engine core process: its error (same class, naming the
    # file) comes back.
    with pytest.raises(ValueError, match=r"Engine core failed to start: ValueError: weights: cannot read .*model\.safetensors"
                       r" \(22 bytes\): .*header") as e:  # fmt: skip
        LLM(str(broken), dtype="float32", kv_cache_memory="32MiB")
    assert type(e.value) is ValueError
    assert not engine_processes()


def test_an_engine_core_that_vanishes_while_starting_is_an_error_not_a_hang(model_dir: str) -> None:
    config = with_platform(create_engine_config(engine_args(model_dir)), ExitsAtStartupPlatform)
    with pytest.raises(RuntimeError, match="Engine core failed to start: its process exited with status 3"):
        AsyncLLM(config)
    assert not engine_processes()


# ----------------------------------------------------------------- utilities across the boundary


def test_lora_utilities_and_prefix_cache_reset_cross_the_process_boundary(model_dir: str, tmp_path: Path) -> None:
    adapter = make_adapter(model_dir, tmp_path / "a1", seed=1, r=8)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    assert isinstance(engine.engine_core, SyncMPClient)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids

    lora = LoRARequest("a1", 1, str(adapter))
    assert engine.add_lora(lora) is True
    assert engine.list_loras() == {1}
    tuned = llm.generate({"prompt_token_ids": PROMPT}, params, lora_request=lora, use_tqdm=False)[0]
    assert tuned.outputs[0].token_ids != base
    # An engine-core error comes back as the same exception, and the engine goes on.
    with pytest.raises(ValueError):
        engine.add_lora(LoRARequest("missing", 2, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="unknown engine core utility"):
        engine.call_utility("shutdown")
    assert engine.remove_lora(1) is True and engine.list_loras() == set()

    state = engine.call_utility("core_state")
    assert state["kv_cache_usage"] == 0.0
    # The engine core froze its start-up heap (freeze_gc_heap), out of the full collections' way.
    assert state["gc_frozen_objects"] > 10_000
    cached = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the prompt's blocks were cached by the first run
    assert engine.reset_prefix_cache() is True
    again = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == base
    engine.shutdown()


def test_async_utilities_run_between_steps(model_dir: str) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(model_dir))
    assert isinstance(engine.engine_core, AsyncMPClient)
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run() -> tuple[dict, dict, bool, set[int]]:
        stream = engine.generate({"prompt_token_ids": PROMPT}, params, "r")
        await stream.__anext__()
        during = await engine.call_utility("core_state")
        await stream.aclose()  # the client went away: aborted in the core
        after = await engine.call_utility("core_state")
        return during, after, await engine.reset_prefix_cache(), await engine.list_loras()

    try:
        during, after, reset, loras = asyncio.run(run())
    finally:
        engine.shutdown()
    assert during["num_unfinished_requests"] == 1 and during["kv_cache_usage"] > 0
    assert after["num_unfinished_requests"] == 0 and after["kv_cache_usage"] == 0.0
    assert reset is True and loras == set()
    assert not engine_processes()


# ----------------------------------------------------------------- faults


def test_the_engine_core_exits_when_its_parent_dies(model_dir: str, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from kvloom import LLM
        llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
        print(llm.llm_engine.engine_core.engine.pid, flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVLOOM_ENABLE_MULTIPROCESSING", None)
    parent = subprocess.Popen([sys.executable, "-c", script, model_dir], stdout=subprocess.PIPE, text=True, env=env)
    try:
        engine_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert is_running(engine_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_gone(engine_pid, timeout=15), "the engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# ----------------------------------------------------------------- KVLOOM_ENABLE_MULTIPROCESSING=0


def test_multiprocessing_off_keeps_the_core_in_this_process(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(320)[:3]]
    in_process = {}
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    assert not multiprocessing_enabled()
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    assert isinstance(llm.llm_engine.engine_core, InprocClient) and not engine_processes()
    in_process["llm"] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert llm.llm_engine.list_loras() == set() and llm.llm_engine.reset_prefix_cache() is True
    engine = AsyncLLM.from_engine_args(engine_args(model_dir))
    assert isinstance(engine.engine_core, ThreadedClient) and not engine_processes()

    async def run() -> list[int]:
        assert (await engine.call_utility("core_state"))["num_unfinished_requests"] == 0
        out = None
        async for out in engine.generate(prompts[0], params, "r"):
            pass
        return out.outputs[0].token_ids

    try:
        in_process["async"] = asyncio.run(run())
    finally:
        engine.shutdown()

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    assert isinstance(llm.llm_engine.engine_core, SyncMPClient)
    separate = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    llm.llm_engine.shutdown()
    # The same tokens and logprobs either way (up to float noise: the engine core process
    # may start stepping before every request of the batch arrived, so batches differ).
    for (tokens, logprobs), (tokens_in, logprobs_in) in zip(separate, in_process["llm"]):
        assert tokens == tokens_in
        for step, step_in in zip(logprobs, logprobs_in):
            assert step.keys() == step_in.keys()
            assert all(abs(step[t].logprob - step_in[t].logprob) < 1e-4 for t in step)
    assert in_process["async"] == separate[0][0]

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "maybe")
    with pytest.raises(ValueError, match="KVLOOM_ENABLE_MULTIPROCESSING"):
        multiprocessing_enabled()


# ----------------------------------------------------------------- one engine core, several front ends


def test_one_engine_core_serves_several_front_ends(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two AsyncLLMs (client_index 0 and 1, as two API servers) connected to one engine
    core started here (as the launcher does): each gets its own requests' outputs (and no
    other's) and utility results, both get the scheduler stats, and both see the core die."""
    received: list[set[str]] = [set(), set()]
    read = AsyncMPClient.get_output_async

    async def spy(self: AsyncMPClient) -> Any:
        outputs = await read(self)
        received[self.client_index].update(o.request_id for o in outputs.outputs)
        return outputs

    monkeypatch.setattr(AsyncMPClient, "get_output_async", spy)
    config = create_engine_config(engine_args(model_dir))
    clients = [ClientAddresses(f"ipc://{tmp_path}/in-{i}", f"ipc://{tmp_path}/out-{i}") for i in range(2)]
    process = EngineCoreProcessHandle(config, True, clients)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(320)[:4]
    seen_stats = [0, 0]

    class StatsSeen(StatLoggerBase):
        def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
            seen_stats[self.client] += scheduler_stats is not None

        def log(self) -> None:
            pass

    def stats_of(client: int) -> Any:
        def factory(config: Any, engine_index: int) -> StatLoggerBase:
            logger = StatsSeen(config, engine_index)
            logger.client = client
            return logger

        return factory

    async def generate(engine: AsyncLLM, prompt: list[int], request_id: str) -> list[int]:
        out = None
        async for out in engine.generate({"prompt_token_ids": prompt}, greedy, request_id):
            pass
        return out.outputs[0].token_ids

    async def run() -> tuple[list[list[int]], list[dict], list[BaseException]]:
        logged = EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="32MiB")
        engines = [AsyncLLM(create_engine_config(logged), stat_loggers=[stats_of(i)], client_index=i,
                            client_addresses=clients[i]) for i in range(2)]  # fmt: skip
        try:
            tokens = await asyncio.gather(*(generate(engines[i % 2], p, f"r{i // 2}-{i % 2}")
                                            for i, p in enumerate(prompts)))  # fmt: skip
            states = await asyncio.gather(*(e.call_utility("core_state") for e in engines))
            # A long request on each; the core is killed; the launcher tells every client.
            long = SamplingParams(max_tokens=3000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            streams = [e.generate({"prompt_token_ids": prompts[0]}, long, f"long-{i}") for i, e in enumerate(engines)]
            for stream in streams:
                await stream.__anext__()
            # A request id that another front end's running request holds is refused (the
            # servers' ids are random); the running one goes on.
            clash = None
            async for clash in engines[1].generate({"prompt_token_ids": prompts[1]}, greedy, "long-0"):
                pass
            assert clash.outputs[0].finish_reason == "abort" and not clash.outputs[0].token_ids
            await streams[0].__anext__()
            os.kill(process.pid, signal.SIGKILL)
            process.process.join(timeout=10)
            for c in clients:
                notify_engine_death(zmq.Context.instance(), c.output, "The engine core process was killed by SIGKILL")
            errors = []
            for stream in streams:
                with pytest.raises(EngineDeadError) as info:
                    async for _ in stream:
                        pass
                errors.append(info.value)
            for e in engines:
                with pytest.raises(EngineDeadError):
                    await e.check_health()
            return tokens, states, errors
        finally:
            for e in engines:
                e.shutdown()

    try:
        tokens, states, errors = asyncio.run(run())
    finally:
        process.stop(send_shutdown=None)
    reference = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", disable_log_stats=True)
    expected = [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    reference.llm_engine.shutdown()
    assert tokens == expected
    assert received == [{"r0-0", "r1-0", "long-0"}, {"r0-1", "r1-1", "long-1", "long-0"}]
    assert all(s["num_unfinished_requests"] == 0 for s in states)
    assert min(seen_stats) > 0  # both front ends got the scheduler stats
    assert all("SIGKILL" in str(e) for e in errors)
    assert not engine_processes()
