"""InputProcessor: validate and tokenize a prompt into an ``EngineCoreRequest``.

Bad input is rejected here, in the front end, with a ``ValueError`` that names the field
and the allowed range, so it never reaches (or disturbs) the engine core.
"""

from __future__ import annotations

import time
from typing import Any

from kvloom.config import EngineConfig
from kvloom.inputs import PromptType
from kvloom.lora.request import LoRARequest
from kvloom.request import EngineCoreRequest
from kvloom.sample.logits_processors import parse_extra_args
from kvloom.sampling_params import PoolingParams, SamplingParams, check_unicode
from kvloom.structured_output.registry import validate_structured_outputs


def _generation_eos_ids(hf_config: Any, model_path: str) -> list[int]:
    """EOS ids from generation_config.json (Llama 3 lists several), if present."""
    import json
    from pathlib import Path

    path = Path(model_path) / "generation_config.json"
    ids: Any = None
    if path.is_file():
        try:
            ids = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            ids = None
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else [int(i) for i in ids]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        eos_ids = _generation_eos_ids(config.model.hf_config, config.model.model)
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id: int | None = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        # Further EOS ids (e.g. Llama 3's <|eot_id|>) act as stop tokens.
        self.extra_eos_ids = [i for i in eos_ids if i != self.eos_token_id]

    def tokenize(self, text: str) -> list[int]:
        check_unicode(text, "prompt")
        if self.tokenizer is None:
            raise ValueError(
                "prompt: text prompts need a tokenizer, but the engine runs with skip_tokenizer_init=True; "
                'pass {"prompt_token_ids": [...]} instead'
            )
        return list(self.tokenizer(text, add_special_tokens=True).input_ids)

    def prompt_token_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenize(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in ids):  # fmt: skip
                    raise ValueError("prompt_token_ids: must be a list of integers")
                if not ids:
                    raise ValueError("prompt_token_ids: must not be empty")
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(
                        f"prompt_token_ids: token id {bad[0]} is out of range (allowed: 0..{self.vocab_size - 1})"
                    )
                return list(ids), prompt.get("prompt")
            if "prompt" in prompt:
                return self.prompt_token_ids(prompt["prompt"])
            raise ValueError('prompt: a dict prompt needs "prompt" or "prompt_token_ids"')
        raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The ranges ``SamplingParams`` cannot check alone: those bounded by the model's
        vocabulary and by ``--max-logprobs`` (``ValueError`` naming the field and its range)."""
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}: {value} is more than this engine allows (allowed range: 0 <= {name} <= "
                                 f"{limit}, max_logprobs)")  # fmt: skip
        v = self.vocab_size
        if params.top_k > v:
            raise ValueError(f"top_k: {params.top_k} is out of range (allowed: -1 or 0 to disable top-k, "
                             f"else 1 <= top_k <= {v}, the vocabulary size)")  # fmt: skip
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of range (allowed: 0..{v - 1})")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: the engine runs without a tokenizer (skip_tokenizer_init), "
                                 "which grammars need")  # fmt: skip
            validate_structured_outputs(params.structured_outputs, self.config.structured_outputs.backend)
        parse_extra_args(params.extra_args)  # each logits processor checks its own value

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        token_ids, text = self.prompt_token_ids(prompt)
        n = len(token_ids)
        pooling = isinstance(params, PoolingParams)
        limit = self.max_model_len if pooling else self.max_model_len - 1
        if n > limit:
            raise ValueError(
                f"prompt: {n} tokens is longer than the maximum of {limit} "
                f"(max_model_len={self.max_model_len}{'' if pooling else ', leaving room for one output token'})"
            )
        runner = self.config.model.runner
        if pooling and runner != "pooling":
            raise ValueError("pooling_params: this model generates text; start it with runner='pooling' to pool")
        if not pooling and runner == "pooling":
            raise ValueError("sampling_params: this model runs as a pooling (embedding) model and cannot generate")
        problem = priority_problem(priority, self.config.scheduler.policy)
        if problem is not None:
            raise ValueError(problem)
        if lora_request is not None and not self.config.lora.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with --enable-lora")
        if not pooling:
            self.check_sampling_params(params)  # type: ignore[arg-type]
        sampling_params = None
        pooling_params = None
        if pooling:
            pooling_params = params  # type: ignore[assignment]
        else:
            sampling_params = params.model_copy()  # type: ignore[union-attr]
            if sampling_params.max_tokens is None:
                sampling_params.max_tokens = self.max_model_len - n
            if self.extra_eos_ids and not sampling_params.ignore_eos:
                sampling_params.stop_token_ids = sorted(set(sampling_params.stop_token_ids) | set(self.extra_eos_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            cache_salt=cache_salt,
            priority=priority,
        )
        return request, text


def priority_problem(priority: int, policy: str) -> str | None:
    """Why ``priority`` cannot be honoured under the scheduling ``policy``, or None: under
    fcfs only 0 is allowed (LLM and the server say the same; the server answers 400)."""
    if priority != 0 and policy != "priority":
        return (
            f"priority: {priority} needs the engine to run with --scheduling-policy priority "
            f"(it uses {policy}; allowed value: 0)"
        )
    return None
