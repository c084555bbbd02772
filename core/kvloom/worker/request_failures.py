"""Per-request failure isolation in the model runner.

The work that belongs to one request (setting up its state, its LoRA adapter, its row of
the sampling state, its prompt logprobs, its pooling) runs through ``RequestFailures.run``:
a failure there fails that request alone (``ModelRunnerOutput.failed``, which the
scheduler turns into ``FinishReason.ERROR``) and the rest of the batch goes on. A failed
request is left out of every later step until the scheduler reports it finished
(``forget``). Only a failure that belongs to no request (the forward pass, the logits)
escapes and takes the engine down.

One object is shared by the runner's parts (inputs, sampler, outputs): each asks it
whether a request has failed and records a failure through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RequestFailures:
    """Requests whose own work failed (id -> why), until the scheduler finishes them."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def run(self, req_id: str, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)``, work that belongs to request ``req_id`` alone ("``what``" names it
        in the log and the request's error). If it raises, the request fails (logged with
        the traceback) and None is returned: the caller leaves the request out."""
        try:
            return fn(*args)
        except Exception as exc:
            logger.exception("Request %s failed in the model runner (%s)", req_id, what)
            self.reasons[req_id] = f"{what} failed ({type(exc).__name__}: {exc})"
            return None

    def add(self, req_id: str, why: str) -> None:
        """Fail a request for a reason found outside ``run`` (its KV failed to load)."""
        self.reasons.setdefault(req_id, why)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.reasons

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def forget(self, req_id: str) -> None:
        """The scheduler finished the request: its failure has been reported."""
        self.reasons.pop(req_id, None)

    def of(self, req_ids: Iterable[str]) -> dict[str, str]:
        """The failures among ``req_ids`` (id -> why)."""
        reasons = self.reasons
        return {r: reasons[r] for r in req_ids if r in reasons} if reasons else {}
