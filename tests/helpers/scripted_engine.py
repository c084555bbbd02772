"""A fake engine that answers every request with a scripted output, piece by piece: each
piece of ``script`` is one token's text, so a test decides where a stream's deltas are cut
(inside a ``</think>`` marker, say). The tokenizer is ``WordTokenizer`` plus the reasoning
markers, with ``get_vocab`` (which reasoning parsers read)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvloom.outputs import CompletionOutput, RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.serve_fakes import FakeAsyncLLM, WordTokenizer, make_config


class MarkerTokenizer(WordTokenizer):
    """``WordTokenizer`` whose vocabulary also has ``<think>`` and ``</think>``, and whose
    chat template renders every role (tool results and calls too) and records the messages
    it was given (``last_messages``)."""

    WORDS = WordTokenizer.WORDS + ["<think>", "</think>"]

    def get_vocab(self) -> dict[str, int]:
        return dict(self.ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            continue_final_message: bool = False, **template_kwargs: Any) -> Any:  # fmt: skip
        self.last_messages = messages
        self.last_template_kwargs = template_kwargs
        parts = []
        for m in messages:
            role = m["role"] if m["role"] in ("system", "user", "assistant") else "user"
            calls = " ".join(c["function"]["name"] for c in m.get("tool_calls") or [])
            parts += [f"<|{role}|>", m["content"], calls]
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return " ".join(p for p in parts if p)


class ScriptedAsyncLLM(FakeAsyncLLM):
    """Every sequence outputs ``script`` (one piece a step), then finishes with
    ``finish_reason`` (``stop``) — or with ``length`` when ``max_tokens`` cuts it first.
    Records each request's prompt and params in ``requests`` as ``FakeAsyncLLM`` does."""

    def __init__(self, script: list[str] | None = None, reasoning_parser: str | None = None, **kwargs: Any) -> None:
        config = kwargs.pop("config", None) or make_config(max_model_len=256)
        config.structured_outputs.reasoning_parser = reasoning_parser
        super().__init__(config=config, tokenizer=MarkerTokenizer(), **kwargs)
        self.script = list(script or ["Hello", " world"])

    async def _run(self, request_id: str, prompt_ids: list[int], prompt_text: str | None, sampling_params: SamplingParams,
                   lora_request: Any, priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        sp = sampling_params
        self.requests[request_id] = dict(prompt_ids=prompt_ids, params=sp, lora=lora_request, priority=priority,
                                         cache_salt=cache_salt)  # fmt: skip
        pieces = self.script[: sp.max_tokens] if sp.max_tokens is not None else self.script
        finish, stop_reason = ("length" if len(pieces) < len(self.script) else "stop"), None
        for k in range(len(pieces)):  # the first stop string ends the output (and is left out)
            text = "".join(pieces[: k + 1])
            hits = [(text.find(stop), stop) for stop in sp.stop if stop in text]
            if hits:
                at, stop_reason = min(hits)
                pieces = pieces[:k] + [text[len("".join(pieces[:k])) : at]]
                finish = "stop"
                break
        delta = sp.output_kind == RequestOutputKind.DELTA
        for step, piece in enumerate(pieces):
            done = step == len(pieces) - 1
            if not delta and not done:
                continue
            text = piece if delta else "".join(pieces)
            ids = [5 + step % 195] if delta else [5 + i % 195 for i in range(len(pieces))]
            outputs = [CompletionOutput(index=i, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                                        finish_reason=finish if done else None,
                                        stop_reason=stop_reason if done else None) for i in range(sp.n)]  # fmt: skip
            yield RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=prompt_ids,
                                prompt_logprobs=None, outputs=outputs, finished=done)  # fmt: skip
