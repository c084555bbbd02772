"""The engine core's structured-output manager (vLLM V1's ``StructuredOutputManager``).

A request with ``structured_outputs`` enters the scheduler in ``WAITING_FOR_FSM``: its
grammar compiles in a thread pool, off the engine core's loop, while the other requests
run. The scheduler asks ``grammar_ready()`` each step; once compiled, the request gets
its own matcher and queues like any other (a grammar that fails to compile fails its
request alone, ``FinishReason.ERROR``). Compiled grammars are cached by (kind, spec), so
n>1 siblings and repeated schemas compile once.

Each step the scheduler has ``grammar_bitmask()`` fill one bitmask row per structured
request that samples in it (the runner masks the logits with it before sampling), and
``accept_tokens()`` advances the matchers with the sampled tokens; a request ends when
its grammar terminates. A matcher always tracks the request's output tokens: before a
row is filled, a matcher ahead of them (tokens dropped) is rolled back and one behind is
advanced, so preemption, which keeps the output tokens, needs nothing more.

With a reasoning parser (``--reasoning-parser``) the grammar binds only the answer after
the reasoning, unless ``enable_in_reasoning``: until then the request's row allows every
token (``reasoning_gate``), and its matcher follows the output tokens from the answer's
start instead of all of them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from kvloom.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar, clean_error
from kvloom.structured_output.reasoning_gate import ReasoningGate
from kvloom.structured_output.registry import get_backend_cls

if TYPE_CHECKING:
    from kvloom.request import Request

logger = logging.getLogger(__name__)

#: Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256


class StructuredOutputStats:
    """Compile times and cache lookups since the last ``take()`` (for the metrics)."""

    def __init__(self) -> None:
        self.compile_times: list[float] = []
        self.cache_queries = 0
        self.cache_hits = 0


class StructuredOutputManager:
    def __init__(
        self,
        backend_name: str,
        vocab_size: int,
        tokenizer_loader: Any,
        max_workers: int = 2,
        reasoning_parser: str | None = None,
        enable_in_reasoning: bool = False,
    ) -> None:
        """``tokenizer_loader()`` returns the model's tokenizer; it is called once, when
        the first structured request arrives (the engine core needs no tokenizer
        otherwise). ``reasoning_parser``: the parser's name, whose grammar binds only the
        answer unless ``enable_in_reasoning``."""
        self.backend_cls = get_backend_cls(backend_name)
        self._reasoning_parser_cls = None
        if reasoning_parser is not None and not enable_in_reasoning:
            from kvloom.reasoning.registry import get_reasoning_parser_cls

            self._reasoning_parser_cls = get_reasoning_parser_cls(reasoning_parser)
        self._gate: ReasoningGate | None = None
        self.vocab_size = vocab_size
        self._tokenizer_loader = tokenizer_loader
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvloom-grammar")
        self._cache: OrderedDict[tuple[str, str, bool], concurrent.futures.Future[Any]] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        self.grammars: dict[str, StructuredOutputGrammar] = {}
        self._bitmask: torch.Tensor | None = None
        self._stats = StructuredOutputStats()
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ compile
    @property
    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                tokenizer = self._tokenizer_loader()
                if tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer (the engine runs "
                                     "with skip_tokenizer_init)")  # fmt: skip
                eos = tokenizer.eos_token_id
                self._backend = self.backend_cls(tokenizer, self.vocab_size, [] if eos is None else [eos])
                parser_cls = self._reasoning_parser_cls
                self._gate = ReasoningGate(parser_cls(tokenizer) if parser_cls is not None else None)
            return self._backend

    @property
    def gate(self) -> ReasoningGate:
        """Where each request's grammar starts (made with the backend)."""
        self.backend  # noqa: B018 (makes the gate)
        assert self._gate is not None
        return self._gate

    def _compile(self, params: Any) -> Any:
        backend = self.backend
        start = time.perf_counter()
        compiled = backend.compile(params)
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            self._stats.compile_times.append(elapsed)
        logger.debug("Compiled a %s grammar in %.3f s", params.kind, elapsed)
        return compiled

    def grammar_init(self, request: Request) -> None:
        """Start compiling the grammar of ``request`` (or take it from the cache)."""
        params = request.sampling_params.structured_outputs  # type: ignore[union-attr]
        key = (params.kind, params.spec(), params.disable_any_whitespace)
        with self._stats_lock:
            self._stats.cache_queries += 1
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._stats.cache_hits += 1
                self._cache.move_to_end(key)
            else:
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        self._pending[request.request_id] = future

    def grammar_ready(self, request: Request) -> bool | str:
        """True once the grammar of ``request`` is compiled and its matcher made; False
        while it compiles; the error message if it failed to compile."""
        request_id = request.request_id
        if request_id in self.grammars:
            return True
        future = self._pending.get(request_id)
        if future is None:
            return "structured outputs: no grammar was started for this request"
        if not future.done():
            return False
        del self._pending[request_id]
        exc = future.exception()
        if exc is not None:
            kind = request.sampling_params.structured_outputs.kind  # type: ignore[union-attr]
            return f"structured_outputs.{kind}: the grammar failed to compile: {clean_error(exc)}"
        try:
            self.grammars[request_id] = self.backend.new_grammar(future.result())
        except Exception as exc:  # a backend's matcher failing is this request's problem only
            return f"structured outputs: making the grammar matcher failed: {clean_error(exc)}"
        self.gate.add(request)
        return True

    # ------------------------------------------------------------------ per step
    def _sync(self, request: Request, grammar: StructuredOutputGrammar, start: int) -> None:
        """Make the matcher's accepted tokens the request's output tokens from ``start``."""
        num_output = len(request.output_token_ids) - start
        ahead = grammar.num_processed_tokens - num_output
        if ahead > 0:
            grammar.rollback(ahead)
        elif ahead < 0 and not grammar.accept_tokens(request.output_token_ids[start + num_output + ahead :]):
            raise RuntimeError(f"request {request.request_id}: its output tokens do not match its grammar")

    def grammar_bitmask(
        self, requests: list[Request], drafts: dict[str, list[int]] | None = None
    ) -> tuple[dict[str, int], torch.Tensor | None]:
        """The bitmask rows of ``requests`` (structured ones that sample this step):
        request id -> its first row, and the rows (int32, CPU). A request with ``drafts``
        (speculative decoding) has one row per verified position, consecutive: the row
        after its output, then after each draft (the matcher advanced over them and
        rolled back)."""
        if not requests:
            return {}, None
        backend = self.backend
        drafts = drafts or {}
        n = sum(1 + len(drafts.get(r.request_id, ())) for r in requests)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = backend.allocate_bitmask(max(n, 16), self.vocab_size)
        bitmask = self._bitmask
        gate = self.gate
        rows: dict[str, int] = {}
        i = 0
        for request in requests:
            rows[request.request_id] = i
            start = gate.answer_start(request)
            request_drafts = drafts.get(request.request_id, ())
            if start is None:  # still reasoning: anything goes (requests get no drafts then)
                bitmask[i : i + 1 + len(request_drafts)].fill_(-1)
                i += 1 + len(request_drafts)
                continue
            grammar = self.grammars[request.request_id]
            self._sync(request, grammar, start)
            grammar.fill_bitmask(bitmask, i)
            gate.widen(request, bitmask, i)
            i += 1
            for num_accepted, token_id in enumerate(request_drafts):
                if not grammar.accept_tokens([token_id]):  # checked when kept: never, unless a backend disagrees
                    bitmask[i : i + len(request_drafts) - num_accepted].fill_(-1)
                    i += len(request_drafts) - num_accepted
                    break
                grammar.fill_bitmask(bitmask, i)
                i += 1
            grammar.rollback(grammar.num_processed_tokens - (len(request.output_token_ids) - start))
        # A copy: the runner may still read it when the next step refills the buffer.
        return rows, bitmask[:n].clone()

    def valid_draft_prefix(self, request: Request, drafts: list[int]) -> int:
        """How many of ``drafts`` (speculative decoding) to keep: those the request's grammar
        accepts after its output, short of one that would terminate it (a token verified
        after that one could not follow it); 0 while it reasons (the grammar does not bind
        yet, but may from a draft on)."""
        start = self.gate.answer_start(request)
        grammar = self.grammars.get(request.request_id)
        if start is None or grammar is None or grammar.is_terminated():
            return 0
        self._sync(request, grammar, start)
        kept = 0
        for token_id in drafts:
            if not grammar.accept_tokens([token_id]):
                break
            if grammar.is_terminated():
                grammar.rollback(1)
                break
            kept += 1
        grammar.rollback(kept)
        return kept

    def accept_tokens(self, request: Request, num_new: int) -> bool:
        """Advance the matcher of ``request`` over its last ``num_new`` output tokens (those
        of the answer: none while it reasons); False if a token is not allowed."""
        start = self.gate.answer_start(request)
        if start is None:
            return True
        output = request.output_token_ids
        return self.grammars[request.request_id].accept_tokens(output[max(start, len(output) - num_new) :])

    def is_terminated(self, request_id: str) -> bool:
        return self.grammars[request_id].is_terminated()

    def wait_for_compile(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a pending grammar to compile (returns at
        once when none is pending)."""
        pending = [f for f in self._pending.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def free(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)
        self._pending.pop(request_id, None)
        if self._gate is not None:
            self._gate.remove(request_id)

    def take_stats(self) -> StructuredOutputStats:
        """Compile times and cache lookups since the last call."""
        with self._stats_lock:
            stats, self._stats = self._stats, StructuredOutputStats()
        return stats

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
