"""What crosses the process boundary (kvloom.engine.serial): requests, step outputs with
logprobs, events, stats and tensors, utility calls and errors come back equal after a
msgpack round trip, with nothing pickled."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvloom.engine.serial import (
    EngineCoreErrorInfo,
    EngineCoreReady,
    MsgpackDecoder,
    MsgpackEncoder,
    RemoteTraceback,
    UtilityOutput,
    UtilityRequest,
    convert_args,
)
from kvloom.lora.request import LoRARequest
from kvloom.metrics.scheduler_stats import PrefixCacheStats, SchedulerStats
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs, EngineLoad, TokenLogprobs
from kvloom.request import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from kvloom.sampling_params import PoolingParams, RequestOutputKind, SamplingParams


def round_trip(obj, kind):
    return MsgpackDecoder(kind).decode(MsgpackEncoder().encode(obj))


@pytest.fixture(autouse=True)
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickled")

    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_requests_with_sampling_lora_and_pooling_params() -> None:
    sampling = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, seed=-3, stop=["\n\n"], stop_token_ids=[7],
                              max_tokens=12, min_tokens=2, logprobs=3, prompt_logprobs=1,
                              output_kind=RequestOutputKind.DELTA)  # fmt: skip
    lora = LoRARequest("adapter", 3, "/adapters/a", base_model_name="base")
    request = EngineCoreRequest("r-1", [1, 2, 3], sampling, eos_token_id=2, arrival_time=12.5, lora_request=lora,
                                cache_salt="salt", priority=-1, client_index=2)  # fmt: skip
    back = round_trip(request, EngineCoreRequest)
    assert back == request
    assert isinstance(back.sampling_params, SamplingParams) and back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert isinstance(back.lora_request, LoRARequest)

    pooling = EngineCoreRequest("p", [4, 5], None, PoolingParams(pooling_type="MEAN", dimensions=8, normalize=False))
    back = round_trip(pooling, EngineCoreRequest)
    assert back == pooling and isinstance(back.pooling_params, PoolingParams)


def test_step_outputs_with_logprobs_events_stats_and_finish() -> None:
    logprobs = [TokenLogprobs([9, 1, 2], [-0.5, -0.25, -1.5], [2, 1, 3])]
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [9], new_logprobs=logprobs, new_prompt_logprobs=logprobs * 2,
                             events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0),
                                     EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.5)],
                             num_cached_tokens=16),  # fmt: skip
            EngineCoreOutput("b", [3, 4], finish_reason=FinishReason.STOP, stop_reason="\n"),
            EngineCoreOutput("c", [], finish_reason=FinishReason.LENGTH, stop_reason=7),
        ],
        scheduler_stats=SchedulerStats(3, 1, 0.25, PrefixCacheStats(2, 40, 16, reset=True), num_preemptions=1),
        timestamp=123.25,
        finished_requests={"b", "c"},
        engine_index=1,
        load=EngineLoad(num_waiting=2, num_running=5, kv_cache_usage=0.5),
    )
    back = round_trip(outputs, EngineCoreOutputs)
    assert back == outputs
    assert back.outputs[1].finish_reason is FinishReason.STOP and back.outputs[1].finished
    assert back.outputs[0].events[1].type is EngineCoreEventType.SCHEDULED
    assert isinstance(back.scheduler_stats.prefix_cache_stats, PrefixCacheStats)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(16).to(torch.bfloat16),
        torch.randn(5).to(torch.float16),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.tensor(2.5),
        torch.empty(0, 4),
        torch.randn(4, 4).t(),  # not contiguous
    ],
    ids=["f32", "bf16", "f16", "i64", "scalar", "empty", "strided"],
)
def test_tensors_travel_as_dtype_shape_and_bytes(tensor: torch.Tensor) -> None:
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("e", [], pooling_output=tensor)])
    back = round_trip(outputs, EngineCoreOutputs).outputs[0].pooling_output
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    assert round_trip([tensor], list)[0].dtype == tensor.dtype  # untyped messages too


def test_utility_calls_results_and_errors() -> None:
    lora = LoRARequest("x", 1, "/a")
    call = round_trip(UtilityRequest(7, "add_lora", [lora]), UtilityRequest)
    assert call.call_id == 7 and call.args == [{"lora_name": "x", "lora_int_id": 1, "lora_path": "/a",
                                                "base_model_name": None}]  # fmt: skip

    def add_lora(lora_request: LoRARequest) -> bool:
        return True

    assert convert_args(add_lora, call.args) == [lora]  # typed as the method says
    assert round_trip(UtilityOutput(7, result={1, 2}), UtilityOutput).result == [1, 2]

    try:
        raise FileNotFoundError("no adapter at /a")
    except FileNotFoundError as e:
        info = EngineCoreErrorInfo.from_exception(e)
    back = round_trip(UtilityOutput(8, error=info), UtilityOutput).error
    error = back.to_exception()
    assert type(error) is FileNotFoundError and str(error) == "no adapter at /a"
    assert isinstance(error.__cause__, RemoteTraceback) and "no adapter at /a" in error.__cause__.tb
    assert back.describe() == "FileNotFoundError: no adapter at /a"

    # A class the front end cannot import falls back to its nearest built-in base.
    odd = EngineCoreErrorInfo("nowhere.module:Odd", "odd", builtin_bases=["ValueError", "Exception"])
    assert type(odd.to_exception("prefixed: odd")) is ValueError
    assert round_trip(EngineCoreReady(pid=5, num_blocks=640), EngineCoreReady).num_blocks == 640


def test_a_256_request_step_encodes_and_decodes_in_milliseconds() -> None:
    """The number quoted in serial.py (0.2-0.4 ms there): generous bound for a loaded CI."""
    import time

    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"cmpl-{i:032x}-0", [1000 + i]) for i in range(256)],
        scheduler_stats=SchedulerStats(256, 0, 0.5),
        timestamp=1.0,
    )
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        decoder.decode(encoder.encode(outputs))
        best = min(best, time.perf_counter() - start)
    assert best < 0.02
