"""The ``vllm serve`` flags a vLLM user types, and what ``kvloom serve`` does with each.

One table (``VLLM_FLAGS``): every flag either works (kvloom defines it, with vLLM's
meaning), is refused with "<flag> is not supported by kvloom yet" (never argparse's
"unrecognized arguments"), or is accepted and ignored with a warning saying why (a flag
that tuned something kvloom does not have). ``add_vllm_flags`` adds the refused and
ignored ones to a parser; ``tests/entrypoints/cli/test_vllm_flags.py`` walks the table and
the README's table lists it for users.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["works", "not supported yet", "ignored"]


@dataclass(frozen=True)
class VllmFlag:
    flag: str
    status: Status
    note: str = ""
    example: tuple[str, ...] = ()
    """Arguments after the flag in a typical use (what the table's test passes)."""


def _works(flag: str, *example: str, note: str = "") -> VllmFlag:
    return VllmFlag(flag, "works", note, example)


def _not_yet(flag: str, *example: str, note: str = "") -> VllmFlag:
    return VllmFlag(flag, "not supported yet", note, example)


def _ignored(flag: str, *example: str, note: str) -> VllmFlag:
    return VllmFlag(flag, "ignored", note, example)


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # ---- model and loading
    _works("--model", "/models/m"),
    _works("--tokenizer", "/models/t"),
    _works("--skip-tokenizer-init"),
    _works("--served-model-name", "name"),
    _works("--dtype", "float16"),
    _works("--max-model-len", "2048"),
    _works("--seed", "1"),
    _works("--load-format", "safetensors"),
    _works("--trust-remote-code", note="accepted; kvloom runs no code from model repositories"),
    _works("--quantization", "none", note="fp8 (online, and fp8 checkpoints) and compressed-tensors (fp8 formats) "
           "through the quantization-method plugins kvloom-quant-fp8 / kvloom-quant-compressed-tensors; a quantized "
           "checkpoint's quantization_config chooses its method without the flag; none keeps weights as stored "
           "(GGUF dequantized); docs/quantization.md"),
    _works("--generation-config", "vllm"),
    _works("--chat-template", "{{ messages }}"),
    _works("--max-logprobs", "5"),
    _works("--runner", "generate"),
    _works("--io-processor-plugin", "name"),
    _works("--revision", "main", note="of a Hugging Face Hub id"),
    _ignored("--code-revision", "main", note="kvloom runs no code from model repositories"),
    _works("--tokenizer-revision", "main", note="of a Hugging Face Hub id"),
    _works("--download-dir", "/tmp/hf", note="the Hugging Face cache folder for hub ids"),
    _not_yet("--hf-token", "t", note="set HF_TOKEN, which huggingface_hub reads"),
    _not_yet("--hf-overrides", "{}"),
    _not_yet("--tokenizer-mode", "slow"),
    _not_yet("--config-format", "mistral"),
    _not_yet("--max-parallel-loading-workers", "2"),
    _not_yet("--rope-scaling", "{}"),
    _not_yet("--rope-theta", "10000"),
    _not_yet("--disable-sliding-window"),
    _not_yet("--override-generation-config", "{}"),
    _not_yet("--logits-processors", "x", note="install the processor as a kvloom.logits_processors entry point"),
    _not_yet("--enable-prompt-embeds"),
    _not_yet("--task", "generate", note="use --runner"),
    _not_yet("--convert", "embed"),
    _not_yet("--pooler-config", "{}"),
    _not_yet("--override-pooler-config", "{}"),
    # ---- cache, scheduler, parallelism
    _works("--block-size", "16"),
    _works("--gpu-memory-utilization", "0.8"),
    _works("--num-gpu-blocks-override", "64"),
    _works("--kv-cache-dtype", "auto"),
    _works("--enable-prefix-caching"),
    _works("--prefix-caching-hash-algo", "sha256"),
    _works("--max-num-seqs", "8"),
    _works("--max-num-batched-tokens", "4096"),
    _works("--long-prefill-token-threshold", "512"),
    _works("--enable-chunked-prefill"),
    _works("--scheduling-policy", "priority"),
    _works("--async-scheduling", note="on by default where the device runs asynchronously (CUDA), as in vLLM; "
           "--no-async-scheduling turns it off"),
    _works("--no-async-scheduling"),
    _works("--tensor-parallel-size", "2", note="one machine, mp executor; Llama/Qwen families"),
    _works("--pipeline-parallel-size", "2", note="one machine, mp executor, eager; Llama/Qwen families"),
    _works("--data-parallel-size", "2"),
    _works("--attention-backend", "NAME"),
    _works("--enforce-eager"),
    _works("--cudagraph-capture-sizes", "1", "2"),
    _works("--max-cudagraph-capture-size", "8"),
    _works("-O", "2"),
    _ignored("--swap-space", "4", note="vLLM V1 does not swap either; preempted requests are recomputed"),
    _ignored("--disable-frontend-multiprocessing", note="kvloom's front end and engine core already share "
             "nothing but sockets"),
    _ignored("--max-seq-len-to-capture", "8192", note="deprecated in vLLM; CUDA graphs are captured by batch size"),
    _works("--kv-cache-memory-bytes", "1000000000", note="also spelled --kv-cache-memory (e.g. 4GiB)"),
    _not_yet("--cpu-offload-gb", "4"),
    _not_yet("--calculate-kv-scales"),
    _not_yet("--preemption-mode", "swap"),
    _works("--distributed-executor-backend", "mp", note="uni, mp or ray (pip install 'kvloom[ray]')"),
    _not_yet("--enable-expert-parallel"),
    _not_yet("--data-parallel-size-local", "1"),
    _not_yet("--data-parallel-address", "127.0.0.1"),
    _not_yet("--data-parallel-rpc-port", "13345"),
    _not_yet("--data-parallel-start-rank", "0"),
    _not_yet("--headless"),
    _not_yet("--decode-context-parallel-size", "2"),
    _not_yet("--disable-custom-all-reduce"),
    _not_yet("--compilation-config", "{}", note="use -O, --cudagraph-mode, --cudagraph-capture-sizes"),
    _works("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
           note="ngram, draft_model, eagle3 (eagle), mtp (deepseek_mtp) or a proposer plugin; docs/speculative_decoding.md"),
    _works("--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}',
           note="ExampleConnector, OffloadingConnector or a kvloom.kv_connectors plugin; docs/kv_connectors.md"),
    _not_yet("--kv-events-config", "{}"),
    _not_yet("--enable-sleep-mode"),
    _works("--structured-outputs-config", '{"enable_in_reasoning": true}',
           note="a JSON object with backend, reasoning_parser, enable_in_reasoning"),
    _not_yet("--guided-decoding-backend", "xgrammar"),
    _not_yet("--limit-mm-per-prompt", "{}", note="kvloom serves text-only models"),
    _not_yet("--mm-processor-kwargs", "{}", note="kvloom serves text-only models"),
    _not_yet("--allowed-local-media-path", "/tmp", note="kvloom serves text-only models"),
    # ---- LoRA
    _works("--enable-lora"),
    _works("--max-loras", "2"),
    _works("--max-lora-rank", "16"),
    _works("--max-cpu-loras", "4"),
    _works("--lora-modules", "a=/p/a"),
    _not_yet("--fully-sharded-loras"),
    _not_yet("--lora-dtype", "float16"),
    # ---- logging and observability
    _works("--disable-log-stats"),
    _works("--disable-log-requests", note="the default: requests are not logged"),
    _works("--enable-log-requests"),
    _not_yet("--enable-log-outputs"),
    _not_yet("--max-log-len", "100"),
    _not_yet("--otlp-traces-endpoint", "http://localhost:4317"),
    _not_yet("--collect-detailed-traces", "all"),
    _not_yet("--kv-cache-metrics-sample", "0.01"),
    # ---- server
    _works("--host", "127.0.0.1"),
    _works("--port", "8001"),
    _works("--api-key", "k"),
    _works("--uvicorn-log-level", "warning"),
    _works("--disable-uvicorn-access-log"),
    _works("--api-server-count", "1"),
    _works("--allowed-origins", '["https://example.com"]'),
    _works("--allowed-methods", '["GET", "POST"]'),
    _works("--allowed-headers", '["*"]'),
    _works("--allow-credentials"),
    _works("--ssl-keyfile", "key.pem"),
    _works("--ssl-certfile", "cert.pem"),
    _works("--root-path", "/api"),
    _works("--response-role", "assistant"),
    _works("--disable-fastapi-docs"),
    _not_yet("--ssl-ca-certs", "ca.pem"),
    _not_yet("--ssl-cert-reqs", "2"),
    _not_yet("--enable-ssl-refresh"),
    _not_yet("--middleware", "module.Middleware"),
    _not_yet("--return-tokens-as-token-ids"),
    _not_yet("--enable-request-id-headers", note="kvloom always sends X-Request-Id"),
    _not_yet("--enable-prompt-tokens-details"),
    _not_yet("--enable-server-load-tracking"),
    _not_yet("--enable-force-include-usage"),
    _not_yet("--enable-tokenizer-info-endpoint"),
    _not_yet("--chat-template-content-format", "openai"),
    _not_yet("--trust-request-chat-template"),
    _works("--enable-auto-tool-choice", "--tool-call-parser", "hermes", note="with --tool-call-parser"),
    _works("--tool-call-parser", "hermes", note="hermes, llama3_json or a kvloom.tool_parsers plugin"),
    _not_yet("--tool-parser-plugin", "plugin.py", note="install the parser as a kvloom.tool_parsers entry point"),
    _not_yet("--tool-server", "demo", note="tool calling"),
    _works("--reasoning-parser", "deepseek_r1", note="deepseek_r1, qwen3 or a kvloom.reasoning_parsers plugin"),
    _not_yet("--log-config-file", "logging.json", note="kvloom's level is KVLOOM_LOGGING_LEVEL"),
    _not_yet("--lora-modules-json", "{}"),
)


def find(flag: str) -> VllmFlag:
    for entry in VLLM_FLAGS:
        if entry.flag == flag:
            return entry
    raise KeyError(flag)


def python_option(name: str) -> VllmFlag | None:
    """The table's entry for ``name`` as a keyword argument of vLLM's ``LLM``/``EngineArgs``
    (``speculative_config`` for ``--speculative-config``), or None."""
    flag = "--" + name.replace("_", "-")
    return next((entry for entry in VLLM_FLAGS if entry.flag == flag), None)


def _note(entry: VllmFlag) -> str:
    return f" ({entry.note})" if entry.note else ""


class _NotSupportedYet(argparse.Action):
    """A vLLM flag kvloom has not built: a usage error that says so (with or without a value)."""

    dest_flag: str = ""  # the table's flag (set per flag by add_vllm_flags)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        parser.error(f"{option_string} is not supported by kvloom yet{_note(find(self.dest_flag))}")


class _Ignored(argparse.Action):
    """A vLLM flag that tunes something kvloom does not have: accepted, with a warning."""

    dest_flag: str = ""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        logger.warning("%s is ignored by kvloom%s", option_string, _note(find(self.dest_flag)))


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add the table's refused and ignored flags to ``parser`` (in a help group of their
    own), except those the parser has already; the working ones are the parser's own."""
    group = parser.add_argument_group("vLLM flags kvloom does not support yet or ignores")
    for entry in VLLM_FLAGS:
        if entry.status == "works" or entry.flag in parser._option_string_actions:
            continue  # the parser's own flag (e.g. --quantization, an EngineArgs field that refuses its values)
        action = _NotSupportedYet if entry.status == "not supported yet" else _Ignored
        cls = type(action.__name__, (action,), {"dest_flag": entry.flag})
        # A switch takes no value, any other flag one (``--flag VALUE`` or ``--flag=VALUE``),
        # so that the arguments after it (the model) are parsed as they would be by vLLM.
        group.add_argument(entry.flag, nargs=1 if entry.example else 0, action=cls, default=argparse.SUPPRESS,
                           metavar="VALUE",
                           dest="vllm_flag_" + entry.flag.lstrip("-").replace("-", "_"),
                           help=f"{entry.status}{_note(entry)}".replace("%", "%%"))  # fmt: skip
