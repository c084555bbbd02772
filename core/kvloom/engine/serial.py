"""What crosses the process boundary between a front end and the engine core, and how.

Everything is msgpack, encoded and decoded with msgspec; nothing is pickled:

* the messages are msgspec Structs (``EngineCoreRequest``, ``EngineCoreOutputs`` and what
  they hold: ``EngineCoreOutput``, ``TokenLogprobs``, ``EngineCoreEvent``) and the ones
  below (utility calls and their results, the startup handshake, errors); dataclasses
  (``LoRARequest``, ``SchedulerStats``, ``PrefixCacheStats``) are encoded by msgspec as
  they are; ``SamplingParams`` / ``PoolingParams`` (pydantic) travel as their field dict
  and are validated again on arrival;
* tensors (pooled embeddings) are a msgpack extension (``EXT_TENSOR``) holding the
  dtype's name, the shape and the raw bytes of the contiguous CPU tensor; any dtype,
  bfloat16 included.

Cost (``python -m kvloom.engine.serial``, on the 2-core development CPU, shared): one
step's outputs for 256 running requests, one new token each, with scheduler stats:
13.8 KB, encode 0.02-0.04 ms, encode + decode 0.11-0.13 ms; with 5 top logprobs per
token: 34.8 KB, encode 0.05-0.07 ms, encode + decode 0.34-0.40 ms. The same outputs as
dataclasses (msgspec encodes them as maps) were 3-4x slower side by side (1.2 ms and
4.3 ms against 0.36 ms and 1.1 ms on a busier machine), hence the Structs (array-like,
defaults omitted).

Frames. Front end -> engine core, on the core's input socket (``ROUTER`` in the front
end, ``DEALER`` in the core, whose identity is its engine index; a core has one per
front end): ``[kind, payload]`` with
kind ``ADD`` (a list of ``EngineCoreRequest``s, admitted together), ``ABORT`` (a list of request ids), ``UTILITY`` (a
``UtilityRequest``) or ``SHUTDOWN`` (empty). The core answers the handshake on the same
socket: ``[READY, EngineCoreReady]`` or ``[FAILED, EngineCoreErrorInfo]``. Engine core ->
front end, on the output socket (``PUSH`` -> ``PULL``): ``[OUTPUTS, EngineCoreOutputs]``,
``[UTILITY_OUTPUT, UtilityOutput]`` or ``[DEAD, EngineCoreErrorInfo]`` (the core failed and
is exiting; the front end's process monitor sends the same when the process vanishes).
"""

from __future__ import annotations

import builtins
import importlib
import traceback
import typing
from typing import Any

import msgspec
import torch
from pydantic import BaseModel

from kvloom.outputs import EngineCoreOutputs
from kvloom.request import EngineCoreRequest
from kvloom.sampling_params import PoolingParams, SamplingParams

# ----------------------------------------------------------------- frame kinds

ADD = b"\x01"
ABORT = b"\x02"
UTILITY = b"\x03"
SHUTDOWN = b"\x04"

READY = b"\x10"
FAILED = b"\x11"

OUTPUTS = b"\x20"
UTILITY_OUTPUT = b"\x21"
DEAD = b"\x22"

#: msgpack extension code of a tensor.
EXT_TENSOR = 1

# ----------------------------------------------------------------- messages


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    """Call ``method`` of the engine core with ``args`` between two steps (named methods
    only: see ``kvloom.engine.core_proc.UTILITY_METHODS``)."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)
    #: The front end that called (the result goes to it only).
    client_index: int = 0


class EngineCoreErrorInfo(msgspec.Struct, array_like=True, gc=False):
    """An exception raised in the engine-core process, as the front end re-raises it."""

    #: The exception's class, ``module:qualname``.
    type_name: str
    message: str
    traceback: str = ""
    #: Names of the built-in exception classes it derives from, nearest first (the
    #: front end re-raises one of these when it cannot import the class itself).
    builtin_bases: list[str] = msgspec.field(default_factory=list)

    @classmethod
    def from_exception(cls, exc: BaseException) -> "EngineCoreErrorInfo":
        kind = type(exc)
        bases = [c.__name__ for c in kind.__mro__ if c.__module__ == "builtins" and issubclass(c, Exception)]
        return cls(
            type_name=f"{kind.__module__}:{kind.__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            builtin_bases=bases,
        )

    @property
    def short_type(self) -> str:
        return self.type_name.rpartition(":")[2]

    def describe(self) -> str:
        """``Type: message`` (``Type`` alone when there is no message)."""
        return f"{self.short_type}: {self.message}" if self.message else self.short_type

    def to_exception(self, message: str | None = None) -> Exception:
        """An exception of the same class where possible (else its nearest built-in
        base, else ``RuntimeError``) with ``message`` (default: the original message),
        whose ``__cause__`` carries the engine core's traceback."""
        text = self.message if message is None else message
        exc: Exception | None = None
        module_name, _, qualname = self.type_name.partition(":")
        try:
            kind: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                kind = getattr(kind, part)
            if isinstance(kind, type) and issubclass(kind, Exception):
                exc = kind(text)
        except Exception:  # not importable here, or it needs other arguments
            exc = None
        if exc is None:
            for name in self.builtin_bases:
                kind = getattr(builtins, name, None)
                if isinstance(kind, type) and issubclass(kind, Exception):
                    try:
                        exc = kind(text)
                        break
                    except Exception:
                        continue
        if exc is None:
            exc = RuntimeError(text)
        if self.traceback:
            exc.__cause__ = RemoteTraceback(self.traceback)
        return exc


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the engine-core process."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\n(in the engine core process)\n{self.tb}"


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: EngineCoreErrorInfo | None = None


class EngineCoreReady(msgspec.Struct, array_like=True, gc=False):
    """The engine core is up: its pid and the configuration values it resolved."""

    pid: int
    num_blocks: int


# ----------------------------------------------------------------- tensors and pydantic


def _encode_tensor(t: torch.Tensor) -> msgspec.msgpack.Ext:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return msgspec.msgpack.Ext(EXT_TENSOR, msgspec.msgpack.encode((dtype, list(t.shape), raw)))


def _decode_tensor(data: memoryview) -> torch.Tensor:
    dtype_name, shape, raw = msgspec.msgpack.decode(data)
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype_name!r}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj)
    if isinstance(obj, BaseModel):
        return obj.__dict__  # SamplingParams / PoolingParams: their fields
    raise NotImplementedError(f"kvloom.engine.serial cannot encode {type(obj).__qualname__}")


_PYDANTIC_TYPES = (SamplingParams, PoolingParams)


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
    elif kind in _PYDANTIC_TYPES:
        return kind.model_validate(obj)
    raise NotImplementedError(f"kvloom.engine.serial cannot decode {kind!r} from {type(obj).__qualname__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_TENSOR:
        return _decode_tensor(data)
    raise NotImplementedError(f"unknown msgpack extension {code}")


class MsgpackEncoder:
    """Encodes any message above (one instance per thread: msgspec encoders are not
    thread-safe)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Decodes messages of type ``kind`` (``Any``: untyped, tensors still decoded)."""

    def __init__(self, kind: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def convert_args(fn: Any, args: list[Any]) -> list[Any]:
    """Give untyped utility arguments (decoded as plain msgpack) the types ``fn``'s
    annotations ask for (a ``LoRARequest`` arrives as a dict)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        return args
    hints.pop("return", None)
    converted = []
    for arg, kind in zip(args, hints.values()):
        try:
            converted.append(msgspec.convert(arg, kind, dec_hook=_dec_hook))
        except (msgspec.ValidationError, NotImplementedError, TypeError):
            converted.append(arg)
    converted.extend(args[len(converted) :])
    return converted


#: The decoders of each input kind, for the engine core's input thread.
def input_decoders() -> dict[bytes, MsgpackDecoder]:
    return {
        ADD: MsgpackDecoder(list[EngineCoreRequest]),
        ABORT: MsgpackDecoder(list[str]),
        UTILITY: MsgpackDecoder(UtilityRequest),
    }


def output_decoders() -> dict[bytes, MsgpackDecoder]:
    return {
        OUTPUTS: MsgpackDecoder(EngineCoreOutputs),
        UTILITY_OUTPUT: MsgpackDecoder(UtilityOutput),
        DEAD: MsgpackDecoder(EngineCoreErrorInfo),
    }


# ----------------------------------------------------------------- measurement


def _benchmark(num_requests: int = 256, repeat: int = 300) -> None:  # pragma: no cover - a tool
    import time

    from kvloom.metrics.scheduler_stats import PrefixCacheStats, SchedulerStats
    from kvloom.outputs import EngineCoreOutput, TokenLogprobs
    from kvloom.request import EngineCoreEvent, EngineCoreEventType

    def step_outputs(logprobs: int) -> EngineCoreOutputs:
        outputs = []
        for i in range(num_requests):
            lps = None
            if logprobs:
                ids = list(range(1000, 1001 + logprobs))
                lps = [TokenLogprobs(ids, [-0.5] * len(ids), list(range(1, len(ids) + 1)))]
            events = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.0)] if i % 50 == 0 else None
            outputs.append(EngineCoreOutput(f"cmpl-{i:032x}-0", [1234 + i], lps, events=events))
        stats = SchedulerStats(num_requests, 3, 0.5, PrefixCacheStats(1, 2, 3))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=1.5, finished_requests={"x"})

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    for logprobs in (0, 5):
        outs = step_outputs(logprobs)
        data = encoder.encode(outs)
        assert decoder.decode(data) == outs
        start = time.perf_counter()
        for _ in range(repeat):
            encoder.encode(outs)
        enc = (time.perf_counter() - start) / repeat
        start = time.perf_counter()
        for _ in range(repeat):
            decoder.decode(encoder.encode(outs))
        both = (time.perf_counter() - start) / repeat
        print(f"{num_requests} outputs, {logprobs} top logprobs: {len(data)} bytes, "
              f"encode {enc * 1e3:.3f} ms, encode+decode {both * 1e3:.3f} ms")  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    _benchmark()
