"""Test doubles for the server and metrics tests: an ``EngineConfig`` built without a
model, a word-level tokenizer and a deterministic ``AsyncLLM`` stand-in that follows the
front-end contract of ``kvloom.engine.async_llm`` (n > 1 fanned out and merged as the
engine's ``ParentRequest`` does).
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import AsyncIterator
from typing import Any

from kvloom.config import EngineConfig, ModelConfig
from kvloom.engine.parallel_sampling import ParentRequest
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.request import EngineCoreRequest
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.model_fixtures import assemble_engine_config


def make_config(
    served_model_name: str = "fake-model",
    max_model_len: int = 64,
    disable_log_stats: bool = False,
    policy: str = "fcfs",
    lora_modules: dict[str, str] | None = None,
    num_blocks: int | None = 100,
    served_model_names: list[str] | None = None,
) -> EngineConfig:
    from types import SimpleNamespace

    import torch

    model = ModelConfig(
        model="/models/fake",
        tokenizer=None,
        skip_tokenizer_init=False,
        served_model_name=served_model_name,
        served_model_names=served_model_names or [],
        hf_config=SimpleNamespace(vocab_size=len(WordTokenizer.WORDS), hidden_size=16),
        architecture="LlamaForCausalLM",
        dtype=torch.float32,
        max_model_len=max_model_len,
        seed=0,
        runner="generate",
    )
    return assemble_engine_config(
        model,
        enable_prefix_caching=True,
        num_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        policy=policy,
        load_format="dummy",
        lora_modules=lora_modules,
        max_lora_rank=8,
        disable_log_stats=disable_log_stats,
    )


# ----------------------------------------------------------------- tokenizer


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary: token i is WORDS[i]. Decoding joins
    with spaces, so text and token ids map back and forth exactly."""

    WORDS = ["<eos>", "<s>", "<|user|>", "<|assistant|>", "<|system|>"] + [f"w{i}" for i in range(5, 200)]
    eos_token_id = 0
    chat_template = "fake"

    def __init__(self) -> None:
        self.ids = {w: i for i, w in enumerate(self.WORDS)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Unknown words map to a stable pseudo-random id (encode is then not invertible).
        ids = [self.ids.get(word, 5 + zlib.crc32(word.encode()) % 195) for word in text.split()]
        return ([1] if add_special_tokens else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and i < 5))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.WORDS[i] for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            continue_final_message: bool = False, **template_kwargs: Any) -> Any:  # fmt: skip
        assert tokenize is False
        self.last_template_kwargs = template_kwargs  # what chat_template_kwargs passed on
        parts = []
        for m in messages:
            if m["role"] == "tool":
                raise ValueError("this template has no tool role")
            parts += [f"<|{m['role']}|>", m["content"]]
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return " ".join(parts)


# ----------------------------------------------------------------- engine


def fake_token(prompt_ids: list[int], position: int, seed: int | None, temperature: float) -> int:
    """The deterministic 'model': greedy picks depend on the prompt and position only;
    sampling also depends on the seed."""
    salt = 0 if temperature == 0 else (seed if seed is not None else 7) * 31
    return 5 + (sum(prompt_ids) * 7 + position * 13 + salt) % 195


def fake_logprob(token_id: int, rank: int) -> float:
    return -0.25 * rank - (token_id % 7) / 100


class _FakeSequence:
    """One sequence of a fake request (what the engine core would run): ``fake_token``s,
    one per ``advance()``."""

    def __init__(self, engine: "FakeAsyncLLM", core_id: str, index: int, prompt_ids: list[int],
                 params: SamplingParams, max_tokens: int) -> None:  # fmt: skip
        self.engine = engine
        self.core_id = core_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self._sent_tokens = self._sent_text_len = self._sent_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def advance(self) -> None:
        sp = self.params
        tokens = self.tokens
        tok = fake_token(self.prompt_ids, len(tokens), sp.seed, sp.temperature)
        if len(tokens) == 3 and not sp.ignore_eos and len(tokens) >= sp.min_tokens and self.prompt_ids[-1] == 9:
            tok = 0  # prompts ending in w9 stop on EOS after 3 tokens
        tokens.append(tok)
        decode = self.engine._decode_token
        if sp.logprobs is not None:
            entry = {tok: Logprob(fake_logprob(tok, 3), 3, decode(tok))}
            for rank in range(1, sp.logprobs + 1):
                alt = 5 + (tok + rank * 11) % 195
                entry.setdefault(alt, Logprob(fake_logprob(alt, rank), rank, decode(alt)))
            self.logprobs.append(entry)
        if tok == 0 and not sp.ignore_eos:
            self.finish_reason, self.stop_reason = "stop", None
        else:
            piece = decode(tok) or ""
            self.text = piece if not self.text else self.text + " " + piece
            for stop in sp.stop:
                at = self.text.find(stop)
                if at != -1 and len(tokens) >= sp.min_tokens:
                    self.text = self.text[:at]
                    self.finish_reason, self.stop_reason = "stop", stop
                    break
        if self.finish_reason is None and len(tokens) >= self.max_tokens:
            self.finish_reason = "length"

    def output(self, delta: bool) -> CompletionOutput:
        """Everything so far, or with ``delta`` what is new since the last delta."""
        want_logprobs = self.params.logprobs is not None
        if delta:
            out = CompletionOutput(
                index=self.index,
                text=self.text[self._sent_text_len :],
                token_ids=self.tokens[self._sent_tokens :],
                cumulative_logprob=None,
                logprobs=self.logprobs[self._sent_logprobs :] if want_logprobs else None,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
            )
            self._sent_tokens, self._sent_text_len, self._sent_logprobs = (
                len(self.tokens), len(self.text), len(self.logprobs))  # fmt: skip
            return out
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.tokens),
            cumulative_logprob=None,
            logprobs=list(self.logprobs) if want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class FakeAsyncLLM:
    """A deterministic ``AsyncLLM``: ``generate`` takes one request with any n and, like
    the engine's front end, fans it out with ``ParentRequest`` (child ids, child i seeded
    with seed + i; n == 1 runs as the request itself) and merges the sequences' outputs
    into one ``RequestOutput`` stream whose ``CompletionOutput.index`` names the sequence.

    Each sequence generates ``fake_token``s one per step, honouring max_tokens,
    min_tokens, stop strings, ignore_eos (token 0 ends a sequence otherwise), logprobs,
    prompt_logprobs and the three output kinds. Records the requests received
    (``requests``, by request id), the sequences as the core would run them
    (``core_requests``, by core id, with their parent and index), and which of those are
    ``active``, ``finished`` or ``aborted`` (closing the stream early aborts every
    unfinished sequence, as ``AsyncLLM`` does)."""

    def __init__(self, config: EngineConfig | None = None, tokenizer: Any = "word", step_delay: float = 0.0) -> None:
        self.config = config or make_config()
        self.tokenizer = WordTokenizer() if tokenizer == "word" else tokenizer
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.core_requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.active: set[str] = set()
        self.peak_active = 0
        self.healthy = True
        self.stat_loggers: list = []

    def get_stat_loggers(self) -> list:
        return self.stat_loggers

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("engine is dead")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer else None

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams,
        lora_request: Any = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (``ValueError`` as ``AsyncLLM.add_request`` raises it), then the
        stream (the request starts running when it is first read)."""
        if isinstance(prompt, dict):
            prompt_ids = list(prompt["prompt_token_ids"])
            prompt_text = None
        else:
            prompt_ids = self.tokenizer.encode(prompt)
            prompt_text = prompt
        if len(prompt_ids) >= self.config.model.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, longer than max_model_len {self.config.model.max_model_len}"
            )
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already running")
        return self._run(request_id, prompt_ids, prompt_text, sampling_params, lora_request, priority, cache_salt)

    async def generate(
        self,
        prompt: str | dict,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, sampling_params, lora_request, priority, cache_salt)
        async for output in stream:
            yield output

    async def _run(
        self,
        request_id: str,
        prompt_ids: list[int],
        prompt_text: str | None,
        sampling_params: SamplingParams,
        lora_request: Any,
        priority: int,
        cache_salt: str | None,
    ) -> AsyncIterator[RequestOutput]:
        sp = sampling_params
        self.requests[request_id] = dict(
            prompt_ids=prompt_ids, params=sp, lora=lora_request, priority=priority, cache_salt=cache_salt
        )
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.config.model.max_model_len - len(prompt_ids)
        max_tokens = min(max_tokens, self.config.model.max_model_len - len(prompt_ids))
        request = EngineCoreRequest(request_id, prompt_ids, sp)
        children = [(0, request)] if sp.n == 1 else ParentRequest(request).child_requests()
        sequences = [
            _FakeSequence(self, child.request_id, index, prompt_ids, child.sampling_params, max_tokens)
            for index, child in children
        ]
        for seq in sequences:
            self.core_requests[seq.core_id] = dict(parent=request_id, index=seq.index, params=seq.params)
            self.active.add(seq.core_id)
        self.peak_active = max(self.peak_active, len(self.active))

        prompt_logprobs = None
        if sp.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                {t: Logprob(fake_logprob(t, 1), 1, self._decode_token(t))} for t in prompt_ids[1:]
            ]
        kind = sp.output_kind
        first = True
        try:
            while not all(seq.finished for seq in sequences):
                await asyncio.sleep(self.step_delay)
                stepped = [seq for seq in sequences if not seq.finished]
                for seq in stepped:
                    seq.advance()
                    if seq.finished:
                        self.finished.append(seq.core_id)
                        self.active.discard(seq.core_id)
                done = all(seq.finished for seq in sequences)
                if kind == RequestOutputKind.FINAL_ONLY and not done:
                    continue
                if kind == RequestOutputKind.DELTA:
                    outputs = [seq.output(delta=True) for seq in stepped]
                else:
                    outputs = [seq.output(delta=False) for seq in sequences]
                yield RequestOutput(
                    request_id=request_id,
                    prompt=prompt_text,
                    prompt_token_ids=prompt_ids,
                    prompt_logprobs=prompt_logprobs if first or kind != RequestOutputKind.DELTA else None,
                    outputs=outputs,
                    finished=done,
                )
                first = False
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.extend(seq.core_id for seq in sequences if not seq.finished)
            raise
        finally:
            self.active.difference_update(seq.core_id for seq in sequences)


def expected_tokens(prompt_ids: list[int], n_tokens: int, seed: int | None = None, temperature: float = 0.0) -> list[int]:
    return [fake_token(prompt_ids, i, seed, temperature) for i in range(n_tokens)]


def expected_text(tokenizer: WordTokenizer, ids: list[int]) -> str:
    return " ".join(tokenizer.decode([t]) for t in ids)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


class ServerThread:
    """A real uvicorn server for ``app`` on a free local port, in a background thread."""

    def __init__(self, app: Any) -> None:
        import socket
        import threading

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        import time

        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_serving(monkeypatch: Any) -> list[dict[str, Any]]:
    """Make ``kvloom serve`` (``main(["serve", ...])``) record what it would serve instead of
    serving: each call's ``serve_http`` arguments land in the returned list, and no port is
    bound (``bind_listening_socket`` gives an unbound socket), so that tests of the flags
    do not need a free port 8000."""
    import socket

    import kvloom.entrypoints.openai.api_server as api_server
    import kvloom.entrypoints.openai.launcher as launcher

    calls: list[dict[str, Any]] = []

    async def fake_serve_http(engine_args: Any, **kwargs: Any) -> None:
        calls.append({"engine_args": engine_args, **kwargs})

    monkeypatch.setattr(api_server, "serve_http", fake_serve_http)
    monkeypatch.setattr(launcher, "bind_listening_socket", lambda host, port: socket.socket())
    return calls
