"""``kvloom generate``: one-shot generation from the command line.

    kvloom generate --prompt "What is the capital of France?" --temperature 0

Each prompt goes in as a user message through the model's chat template when it has
one; ``--raw`` sends the plain text for completion instead. With no ``--model`` the
default SmolLM2-135M-Instruct runs. The engine core runs in this process (a quicker
start; KVLOOM_ENABLE_MULTIPROCESSING=1 gives it its own, as LLM and serve do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens, help="Max new tokens per prompt.")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None, help="Seed for reproducible sampling.")


#: SamplingParams field -> the flag that sets it (for error messages).
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                  "top_k": "--top-k", "seed": "--sampling-seed"}  # fmt: skip


def sampling_params_from(ns: argparse.Namespace, **extra: Any) -> Any:
    """``SamplingParams`` from the sampling flags; a bad value is a ``ValueError`` naming
    the flag and its allowed range (``--top-p: ... (allowed range: 0.0 < top_p <= 1.0)``)."""
    from pydantic import ValidationError

    from kvloom.entrypoints.cli.validation import describe_validation_error
    from kvloom.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            top_k=ns.top_k,
            seed=ns.sampling_seed,
            **extra,
        )
    except ValidationError as exc:
        flag_for = lambda name: SAMPLING_FLAGS.get(name, name)  # noqa: E731
        raise ValueError(describe_validation_error(exc, SamplingParams, flag_for)) from None


def register_subparser(subparsers: Any) -> None:
    from kvloom.entrypoints.cli.engine_args import add_engine_args

    parser = subparsers.add_parser("generate", help="Generate text for one or more prompts.", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", action="append", required=True, help="A prompt (repeat for several).")
    parser.add_argument("--raw", action="store_true", help="Send prompts as plain text (no chat template).")
    parser.add_argument("--json", action="store_true", help="Print results as JSON.")
    parser.add_argument(
        "--lora", default=None, metavar="NAME",
        help="Generate through LoRA adapter NAME, one of --lora-modules NAME=PATH (turns on --enable-lora).",
    )  # fmt: skip
    add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from kvloom.entrypoints.cli.engine_args import engine_args_from_namespace
    from kvloom.entrypoints.llm import LLM

    params = sampling_params_from(ns)  # validate before loading the model
    args = engine_args_from_namespace(ns, **({"enable_lora": True} if ns.lora else {}))
    lora_request = _lora_request(ns.lora, args.lora_modules or {})
    with _engine_core_in_this_process(args.data_parallel_size):
        llm = LLM(**args.model_dump())  # every field, defaults included: LLM runs with what --help shows
    try:
        return _generate(ns, llm, params, lora_request)
    finally:
        llm.llm_engine.shutdown()  # the stat loggers' last log()


@contextlib.contextmanager
def _engine_core_in_this_process(data_parallel_size: int) -> Iterator[None]:
    """A one-shot command gains nothing from an engine core process of its own but pays for
    it (a second interpreter importing torch: seconds of a start of a few): the core runs
    in this process unless KVLOOM_ENABLE_MULTIPROCESSING says otherwise (or data
    parallelism needs processes)."""
    from kvloom.engine.core_client import MULTIPROCESSING_ENV

    if MULTIPROCESSING_ENV in os.environ or data_parallel_size > 1:
        yield
        return
    os.environ[MULTIPROCESSING_ENV] = "0"
    try:
        yield
    finally:
        del os.environ[MULTIPROCESSING_ENV]


def _lora_request(name: str | None, modules: dict[str, str]) -> Any:
    """The ``LoRARequest`` for ``--lora NAME`` (None without it)."""
    if name is None:
        return None
    if name not in modules:
        known = ", ".join(sorted(modules)) or "none"
        raise ValueError(f"--lora: no adapter named {name!r} in --lora-modules (given: {known}); "
                         f"pass --lora-modules {name}=PATH")  # fmt: skip
    from kvloom.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=1, lora_path=modules[name])


def _generate(ns: argparse.Namespace, llm: Any, params: Any, lora_request: Any = None) -> int:
    tokenizer = llm.get_tokenizer()
    use_chat = not ns.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    prompts: list[Any] = [
        llm.apply_chat_template([{"role": "user", "content": p}]) if use_chat else p for p in ns.prompt
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    if ns.json:
        results = [
            {
                "prompt": text,
                "text": out.outputs[0].text,
                "token_ids": out.outputs[0].token_ids,
                "finish_reason": out.outputs[0].finish_reason,
                "num_prompt_tokens": len(out.prompt_token_ids),
            }
            for text, out in zip(ns.prompt, outputs)
        ]
        json.dump(results, sys.stdout, indent=2, ensure_ascii=False)
        print()
    else:
        for text, out in zip(ns.prompt, outputs):
            if len(ns.prompt) > 1:
                print(f"### {text}")
            print(out.outputs[0].text)
    return 0
