"""POST /tokenize and /detokenize: the server's tokenizer (and chat template) as a service."""

from __future__ import annotations

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize_request(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.resolve_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.render_chat([m.for_template() for m in request.messages], request.add_generation_prompt)
            prompt = self.tokenize(text, request.add_special_tokens, param="messages")
        else:
            prompt = self.tokenize(request.prompt, request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = list(self.tokenizer.convert_ids_to_tokens(prompt.token_ids))
        return TokenizeResponse(
            count=len(prompt.token_ids),
            max_model_len=self.max_model_len,
            tokens=prompt.token_ids,
            token_strs=token_strs,
        )

    def detokenize_request(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.resolve_model(request.model)
        tokenizer = self.require_tokenizer("tokens")
        try:
            return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
        except (IndexError, KeyError, OverflowError, TypeError, ValueError) as exc:
            raise APIError(f"tokens: cannot be decoded ({type(exc).__name__}: {exc})", param="tokens") from None
