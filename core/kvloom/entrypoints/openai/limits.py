"""What one request may ask of the server (``kvloom serve`` flags), and where the work
done before a request is admitted runs.

* ``--max-request-body-bytes``: a larger body is refused with 413 before it is read (by
  its Content-Length, or as soon as a chunked body passes the limit). The default fits the
  longest legal request for the model's ``max_model_len``: a prompt of ``max_model_len``
  tokens written out as JSON (``BODY_BYTES_PER_TOKEN`` bytes a token covers any token's
  text, escaped, or its id in a list), and never less than ``MIN_DEFAULT_BODY_BYTES``.
* ``--max-sequences-per-request``: prompts x ``n`` (the engine requests one HTTP request
  makes) above it is a 400.
* ``--max-json-depth``, ``--max-json-number-length``: a body nested deeper, or with a
  longer number literal, is a 400 (``errors.parse_json_body``).

Parsing a body, tokenizing a prompt, rendering a chat template and detokenizing are pure
CPU work on the request's own input: above ``OFFLOAD_CHARS`` (characters, bytes or token
ids) they run in a small thread pool (``run_blocking``), so that one client's large input
never stalls the event loop that serves everyone else (``/health`` included). Tokenizers
release the GIL while they encode.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kvloom.entrypoints.openai.errors import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_JSON_NUMBER_LENGTH

T = TypeVar("T")

MIN_DEFAULT_BODY_BYTES = 4 * 2**20
BODY_BYTES_PER_TOKEN = 128
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
#: Work on inputs at most this large runs inline on the event loop (it takes well under a
#: millisecond); larger inputs go to the thread pool.
OFFLOAD_CHARS = 32 * 1024
#: Threads for work before admission: enough to keep a large tokenization from queueing
#: behind another, few enough to leave the engine its CPU.
OFFLOAD_THREADS = 2


@dataclass(frozen=True)
class ServerLimits:
    #: None: ``default_max_body_bytes(max_model_len)``.
    max_request_body_bytes: int | None = None
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_json_number_length: int = DEFAULT_MAX_JSON_NUMBER_LENGTH

    def __post_init__(self) -> None:
        for name in ("max_sequences_per_request", "max_json_depth", "max_json_number_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1 (got {getattr(self, name)})")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes: must be at least 1024 (got {self.max_request_body_bytes})")

    def body_limit(self, max_model_len: int) -> int:
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return default_max_body_bytes(max_model_len)


def default_max_body_bytes(max_model_len: int) -> int:
    return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@functools.lru_cache(maxsize=1)
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=OFFLOAD_THREADS, thread_name_prefix="kvloom-preadmission")


async def run_blocking(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: inline when its input (``size`` characters, bytes or token ids) is
    small, else in the pre-admission thread pool."""
    if size <= OFFLOAD_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)
