"""The engine's errors: those that end one request while the engine serves on, and
``EngineDeadError``, which ends the engine.

A request the engine core refuses when it arrives ends with ``FinishReason.ABORT`` and a
message (``EngineCoreOutput.error``); one whose own work fails in a step (its sampling,
prompt logprobs, pooling, LoRA adapter) ends with ``FinishReason.ERROR``. The front end
raises these from the request's output stream (``AsyncLLM``); ``LLM``/``LLMEngine`` return
the finished output with that finish reason. Only a failure of the model step itself kills
the engine (``EngineDeadError``).
"""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """The engine refused the request when it arrived (its input cannot be served). The
    client's fault: the server answers 400 with the message."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestFailedError(RuntimeError):
    """The request's own work failed inside the engine; the other requests went on. The
    server answers 500 ("internal error") and logs the message."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id
        self.detail = message


class EngineDeadError(RuntimeError):
    """The engine core failed; no further requests can be served."""
