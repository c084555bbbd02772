"""InputProcessor: validate and tokenize a request (``RequestInput``) into an
``EngineCoreRequest``.

Bad input is rejected here, in the front end, with a ``ValueError`` that names the field
and the allowed range, so it never reaches (or disturbs) the engine core. The rules the
model bounds (token ids, lengths, ``logprobs``, ...) are ``kvloom.model_limits``', which
the server and the engine core apply too.
"""

from __future__ import annotations

import time
from typing import Any

from kvloom.config import EngineConfig
from kvloom.inputs import PromptType, RequestInput
from kvloom.model_limits import ModelLimits, check_against_model
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
        self.limits = ModelLimits.of(config.model)
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
        """The prompt's token ids and its text (None for token ids alone); their range and
        length are checked with the other model-bounded rules (``check_against_model``)."""
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
                return list(ids), prompt.get("prompt")
            if "prompt" in prompt:
                return self.prompt_token_ids(prompt["prompt"])
            raise ValueError('prompt: a dict prompt needs "prompt" or "prompt_token_ids"')
        raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """A grammar the structured-output backend cannot compile is a ``ValueError`` here."""
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: the engine runs without a tokenizer (skip_tokenizer_init), "
                                 "which grammars need")  # fmt: skip
            validate_structured_outputs(params.structured_outputs, self.config.structured_outputs.backend)
        parse_extra_args(params.extra_args)  # each logits processor checks its own value

    def process(self, request: RequestInput) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize ``request``: the ``EngineCoreRequest`` and the prompt's text."""
        token_ids, text = self.prompt_token_ids(request.prompt)
        params = request.params
        pooling = isinstance(params, PoolingParams)
        runner = self.config.model.runner
        if pooling and runner != "pooling":
            raise ValueError("pooling_params: this model generates text; start it with runner='pooling' to pool")
        if not pooling and runner == "pooling":
            raise ValueError("sampling_params: this model runs as a pooling (embedding) model and cannot generate")
        problem = priority_problem(request.priority, self.config.scheduler.policy)
        if problem is not None:
            raise ValueError(problem)
        if request.lora_request is not None and not self.config.lora.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with --enable-lora")
        problems = check_against_model(params, token_ids, self.limits)
        if problems:
            raise ValueError(problems[0][1])
        sampling_params = None
        pooling_params = None
        if isinstance(params, PoolingParams):
            pooling_params = params
        else:
            self.check_structured_outputs(params)
            sampling_params = params.model_copy()
            if sampling_params.max_tokens is None:
                sampling_params.max_tokens = self.limits.max_model_len - len(token_ids)
            if self.extra_eos_ids and not sampling_params.ignore_eos:
                sampling_params.stop_token_ids = sorted(set(sampling_params.stop_token_ids) | set(self.extra_eos_ids))
        core_request = EngineCoreRequest(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if request.arrival_time is None else request.arrival_time,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
            priority=request.priority,
        )
        return core_request, text


def priority_problem(priority: int, policy: str) -> str | None:
    """Why ``priority`` cannot be honoured under the scheduling ``policy``, or None: under
    fcfs only 0 is allowed (LLM and the server say the same; the server answers 400)."""
    if priority != 0 and policy != "priority":
        return (
            f"priority: {priority} needs the engine to run with --scheduling-policy priority "
            f"(it uses {policy}; allowed value: 0)"
        )
    return None
