"""``LLM``: offline batch inference (vLLM's class of the same name).

    from kvloom import LLM, SamplingParams
    llm = LLM()                                  # the default SmolLM2 model
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.llm_engine import LLMEngine
from kvloom.inputs import PromptType
from kvloom.lora.request import LoRARequest
from kvloom.metrics.reader import Metric
from kvloom.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvloom.pooling.io_processors import as_prompt_list, load_io_processor
from kvloom.pooling.score import ScorePlan, score_pairs
from kvloom.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]


class LLM:
    """Offline inference over a batch of prompts. Keyword arguments are ``EngineArgs``
    fields (``dtype``, ``max_model_len``, ``block_size``, ``attention_backend``, ...), with
    ``EngineArgs``' defaults: like ``kvloom generate``, ``LLM`` keeps engine stats and runs
    the stat logger plugins unless ``disable_log_stats=True`` (vLLM's ``LLM`` turns stats
    off by default; kvloom has one default, ``EngineArgs.disable_log_stats``)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model=model, **kwargs)
        start = time.perf_counter()
        self.llm_engine = LLMEngine.from_engine_args(args)
        logger.info("LLM engine for %s ready in %.2f s", self.config.model.served_model_name, time.perf_counter() - start)
        self._counter = itertools.count()

        #: The IO processor plugin (``io_processor_plugin``); ``encode`` runs it when set.
        self.io_processor = load_io_processor(self.config)

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.llm_engine.config

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (vLLM's API); False when blocks are still in use
        by running requests, so nothing was reset."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (vLLM's API): ``Counter``, ``Gauge`` and
        ``Histogram`` objects of ``kvloom.metrics.reader``, named as ``/metrics`` names
        them (``kvloom:prompt_tokens``, ...). Needs stats on (the default)."""
        return self.llm_engine.get_metrics()

    # ------------------------------------------------------------------ generation
    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` of a call without any: the model's generation config
        (``generation_config``, default ``auto``: its ``generation_config.json``) over
        kvloom's defaults, as in vLLM."""
        return SamplingParams(**self.config.model.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        return self._run(prompt_list, params, use_tqdm, lora_request, priority)  # type: ignore[return-value]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (OpenAI-style messages)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        prompts = [self.apply_chat_template(c, chat_template, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(
        self, messages: ChatMessages, chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> PromptType:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, but the engine runs with skip_tokenizer_init=True")
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "chat: the model's tokenizer has no chat template; pass one with --chat-template PATH_OR_STRING "
                "(kvloom chat / serve) or chat_template= (LLM.chat)"
            )
        ids = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return {"prompt_token_ids": list(ids)}

    # ------------------------------------------------------------------ pooling
    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt. With an IO processor plugin, ``prompts`` is the plugin's input
        instead: parse_data -> pre_process -> pool each model prompt -> post_process, and
        the one result is the ``outputs`` of a single ``PoolingRequestOutput``."""
        if self.io_processor is None:
            return self._encode(prompts, pooling_params, use_tqdm, lora_request)
        processor = self.io_processor
        request_id = f"io-{next(self._counter)}"

        model_prompts = as_prompt_list(processor.pre_process(processor.parse_data(prompts), request_id=request_id))
        params = processor.merge_pooling_params(pooling_params if isinstance(pooling_params, PoolingParams) else None)
        outputs = self._encode(model_prompts, params, use_tqdm, lora_request)
        result = processor.post_process(outputs, request_id=request_id)
        return [PoolingRequestOutput(request_id, result, prompt_token_ids=[], finished=True)]  # type: ignore[arg-type]

    def _encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[PoolingRequestOutput]:
        if self.config.model.runner != "pooling":
            raise ValueError("encode: this model runs as a generator; start it with runner='pooling'")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        return self._run(prompt_list, params, use_tqdm, lora_request, None)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        outputs = self._encode(prompts, pooling_params, use_tqdm, None)  # never through an IO processor
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in outputs
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's ``LLM.score``): ``data_1`` (one text, or a list as long as
        ``data_2``) against ``data_2``. A cross-encoder (a ``*ForSequenceClassification``
        model with one label) reads each pair as one prompt and gives sigmoid(logit); an
        embedding model gives the cosine of the two texts' embeddings."""
        plan = ScorePlan(self.config, self.get_tokenizer(), score_pairs(data_1, data_2, ("data_1", "data_2")))
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in plan.prompts]
        outs = self._encode(prompts, PoolingParams(), use_tqdm, lora_request)
        scores = plan.scores([o.outputs.data for o in outs])
        return [
            ScoringRequestOutput("-".join(outs[j].request_id for j in plan.sources(i)), ScoringOutput(score),
                                 [t for j in plan.sources(i) for t in outs[j].prompt_token_ids])
            for i, score in enumerate(scores)
        ]  # fmt: skip

    # ------------------------------------------------------------------ engine loop
    def _run(
        self,
        prompts: list[PromptType],
        params: Any,
        use_tqdm: bool,
        lora_request: Any,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput | PoolingRequestOutput]:
        n = len(prompts)
        param_list = list(params) if isinstance(params, Sequence) else [params] * n
        if len(param_list) != n:
            raise ValueError(f"sampling_params: got {len(param_list)} for {n} prompts (pass one, or one per prompt)")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * n
        priorities = list(priority) if priority is not None else [0] * n
        if len(loras) != n or len(priorities) != n:
            raise ValueError("lora_request and priority: pass one per prompt")

        # Offline batches return finished requests only, so the front end need not build a
        # RequestOutput for every request at every step (vLLM does the same).
        param_list = [
            p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY}) if isinstance(p, SamplingParams) else p
            for p in param_list
        ]
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            # Everything is validated before the first request runs: a bad prompt in a batch
            # raises here and the requests added so far are aborted, leaving the engine idle.
            for prompt, p, lora, prio in zip(prompts, param_list, loras, priorities):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, p, lora_request=lora, priority=prio)
                request_ids.append(request_id)
        except Exception:
            if request_ids:
                engine.abort_request(request_ids)
            raise

        results: dict[str, Any] = {}
        bar = tqdm(total=n, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        speed = _TokenRates()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if use_tqdm:
                            bar.set_postfix_str(speed.add(out), refresh=False)
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]


class _TokenRates:
    """vLLM's progress-bar postfix: prompt and generated tokens per second of the
    requests finished so far, since the batch started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0

    def add(self, out: RequestOutput | PoolingRequestOutput) -> str:
        self.input_tokens += len(out.prompt_token_ids or [])
        if isinstance(out, RequestOutput):
            self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed:.2f} toks/s"
        )
