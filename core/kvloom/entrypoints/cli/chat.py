"""``kvloom chat``: an interactive chat that streams the reply token by token.

Type a message and press Enter; an empty line or EOF (Ctrl-D) ends the session,
``/reset`` forgets the conversation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register_subparser(subparsers: Any) -> None:
    from kvloom.entrypoints.cli.engine_args import add_engine_args
    from kvloom.entrypoints.cli.generate import add_sampling_args

    parser = subparsers.add_parser("chat", help="Chat interactively (streams tokens).", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default=None, help="A system message to start the conversation.")
    add_sampling_args(parser, default_max_tokens=256)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from kvloom.entrypoints.cli.engine_args import engine_args_from_namespace
    from kvloom.entrypoints.cli.generate import sampling_params_from
    from kvloom.entrypoints.llm import LLM
    from kvloom.sampling_params import RequestOutputKind

    params = sampling_params_from(ns, output_kind=RequestOutputKind.DELTA)
    llm = LLM(**engine_args_from_namespace(ns).model_dump())  # every field, defaults included
    try:
        return _converse(ns, llm, params)
    finally:
        llm.llm_engine.shutdown()  # the stat loggers' last log()


def _converse(ns: argparse.Namespace, llm: Any, params: Any) -> int:
    engine = llm.llm_engine
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        # --chat-template is an engine flag: the engine sets it on the tokenizer.
        request_id = f"chat-{turn}"
        turn += 1
        engine.add_request(request_id, llm.apply_chat_template(messages), params)
        reply: list[str] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].text
                reply.append(delta)
                print(delta, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
