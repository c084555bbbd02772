"""An engine core client that runs no model, for tests and benchmarks of the front end
(``AsyncLLM``'s output handler, the collectors, the server's streams).

``ScriptedEngineCore`` stands where ``AsyncLLM`` keeps its ``AsyncMPClient``: each step it
gives every running request its next token (``token_ids`` cycled) until ``max_tokens``.
``steps_per_read`` steps become ready together, as when the engine core runs ahead of
the front end and several step messages wait on the socket: ``get_output_async`` then
returns the ones already made without waiting. ``step_delay`` is the time one batch of
steps takes; ``lag`` ages every step's timestamp (a front end that far behind).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvloom.engine.core_client import EngineCoreClient, ThreadedClient
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs
from kvloom.request import EngineCoreRequest, FinishReason


def word_token_ids(tokenizer_dir: str, count: int) -> list[int]:
    """``count`` token ids of the byte-level BPE tokenizer in ``tokenizer_dir`` that each
    decode to a word with its leading space: every one of them makes a text delta of its
    own (a stream's events and tokens can be counted from the text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    words = [i for i, piece in enumerate(pieces) if piece.startswith("\u0120") and len(piece) > 2 and piece[1:].isalpha()]
    if len(words) < count:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {len(words)} whole-word tokens, not {count}")
    return words[:count]


class ScriptedEngineCore(ThreadedClient):
    """A ``ThreadedClient`` by type only (``AsyncLLM`` takes the asyncio kinds): no thread,
    no engine core; none of the base class's state is made."""

    def __init__(self, token_ids: list[int], steps_per_read: int = 1, step_delay: float = 0.0,
                 lag: float = 0.0) -> None:  # fmt: skip  # noqa: D107
        self.token_ids = token_ids
        self.steps_per_read = steps_per_read
        self.step_delay = step_delay
        self.lag = lag  # how old each step's outputs claim to be (a front end behind the engine)
        self.dead_error: BaseException | None = None
        self.running: dict[str, list[Any]] = {}  # request id -> [max_tokens, produced]
        self.ready: deque[EngineCoreOutputs] = deque()
        self.steps = 0
        self._wake: asyncio.Event | None = None

    @classmethod
    def install(cls, monkeypatch: Any, core: ScriptedEngineCore) -> None:
        """Make the next ``AsyncLLM`` use ``core`` instead of starting an engine core."""
        monkeypatch.setattr(EngineCoreClient, "make_client", staticmethod(lambda *args, **kwargs: core))

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()

    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        assert params is not None and params.max_tokens is not None
        self.running[request.request_id] = [params.max_tokens, 0]
        if self._wake is not None:
            self._wake.set()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    async def get_output_async(self) -> EngineCoreOutputs:
        if self.ready:  # made with an earlier batch: already waiting, returned at once
            return self.ready.popleft()
        assert self._wake is not None
        while not self.running:
            self._wake.clear()
            await self._wake.wait()
        await asyncio.sleep(self.step_delay)
        for _ in range(self.steps_per_read):
            if self.running:
                self.ready.append(self._step())
        return self.ready.popleft()

    def _step(self) -> EngineCoreOutputs:
        self.steps += 1
        outputs = []
        for request_id, state in list(self.running.items()):
            max_tokens, produced = state
            token = self.token_ids[produced % len(self.token_ids)]
            state[1] = produced = produced + 1
            done = produced >= max_tokens
            outputs.append(EngineCoreOutput(request_id, [token], finish_reason=FinishReason.LENGTH if done else None))
            if done:
                del self.running[request_id]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic() - self.lag)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"the scripted engine core has no {method}")

    def shutdown(self) -> None:
        self.running.clear()
