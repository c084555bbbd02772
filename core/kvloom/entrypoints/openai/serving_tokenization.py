"""POST /tokenize and /detokenize: the server's tokenizer (and chat template) as a service."""

from __future__ import annotations

from typing import Any

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.limits import run_blocking
from kvloom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize_request(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Tokenize a prompt or chat (large ones off the event loop). It reports lengths,
        so prompts longer than the context are tokenized too, up to 64 x max_model_len
        tokens (a longer one is a 400 after tokenizing a prefix of it)."""
        self.resolve_model(request.model)
        limit = 64 * self.max_model_len
        if isinstance(request, TokenizeChatRequest):
            messages = [m.for_template() for m in request.messages]
            prompt = await self.chat_prompt_async(messages, request.add_generation_prompt, request.add_special_tokens)
        else:
            prompt = await self.tokenize_async(request.prompt, request.add_special_tokens, limit=limit)
        token_strs = None
        if request.return_token_strs:
            token_strs = list(self.tokenizer.convert_ids_to_tokens(prompt.token_ids))
        return TokenizeResponse(
            count=len(prompt.token_ids),
            max_model_len=self.max_model_len,
            tokens=prompt.token_ids,
            token_strs=token_strs,
        )

    async def detokenize_request(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.resolve_model(request.model)
        tokenizer = self.require_tokenizer("tokens")
        self.check_token_ids(request.tokens, "tokens")
        text = await run_blocking(len(request.tokens), self._decode, tokenizer, request.tokens)
        return DetokenizeResponse(prompt=text)

    @staticmethod
    def _decode(tokenizer: Any, tokens: list[int]) -> str:
        try:
            text = tokenizer.decode(tokens)
        except (IndexError, KeyError, OverflowError, TypeError, ValueError) as exc:
            raise APIError(f"tokens: cannot be decoded ({type(exc).__name__}: {exc})", param="tokens") from None
        # Byte-level tokens can decode to lone surrogates no response can carry.
        return text.encode("utf-8", "replace").decode("utf-8") if not text.isascii() else text
