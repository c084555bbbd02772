"""Greedy agreement of quantized GGUF paths with the float32 dequantized model (issue 40).

The reference is kvloom's dequantized float32 path (``--quantization none``): 1,000 greedy
tokens (EOS ignored) after a chat prompt. Each candidate — kvloom with kvloom-quant-gguf
(the default) and, when ``llama_cpp`` imports, llama.cpp on the same file — is measured two
ways:

* **teacher-forced top-1 agreement**: fed the reference's tokens, how often its greedy choice
  at each of the 1,000 positions is the reference's token (divergence cannot cascade);
* **free-running**: its own 1,000 greedy tokens, the first position where they differ from
  the reference, and the share of positions that are equal.

Usage: ``python benchmarks/gguf_agreement.py [--model X.gguf] [--tokens 1000] [--threads 2] [--markdown F]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from kvloom import LLM, SamplingParams
from kvloom.entrypoints.cli.bench_throughput import report_header

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle."


def kvloom_paths(llm: LLM, prompt: list[int], tokens: int, reference: list[int] | None) -> dict[str, Any]:
    """Free-running greedy tokens, and (given a reference) the top-1 choice at each of its positions."""
    free = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=tokens,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    result: dict[str, Any] = {"free": list(free)}
    if reference is not None:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": prompt + reference}], params, use_tqdm=False)[0]
        positions = out.prompt_logprobs[len(prompt) :]
        result["top1"] = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions]
    return result


def compare(reference: list[int], candidate: dict[str, Any]) -> dict[str, float]:
    free = candidate["free"]
    first = next((i for i, (a, b) in enumerate(zip(reference, free)) if a != b), len(reference))
    row = {"first_divergence": first, "free_equal": sum(a == b for a, b in zip(reference, free)) / len(reference)}
    if "top1" in candidate:
        row["teacher_forced"] = sum(a == b for a, b in zip(reference, candidate["top1"])) / len(reference)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A .gguf file (default: the default model).")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--markdown", default=None, help="Append the results here (with machine, date, command).")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)

    base: dict[str, Any] = {"dtype": "float32"} | ({"model": ns.model} if ns.model else {})
    fp32 = LLM(quantization="none", **base)
    path = str(fp32.config.model.model)
    prompt = chat_prompt(fp32.get_tokenizer())
    reference = kvloom_paths(fp32, prompt, ns.tokens, None)["free"]
    fp32.llm_engine.shutdown()
    del fp32

    rows: dict[str, dict[str, float]] = {}
    quantized = LLM(**base)
    rows["kvloom, kvloom-quant-gguf (default)"] = compare(reference, kvloom_paths(quantized, prompt, ns.tokens, reference))
    quantized.llm_engine.shutdown()
    del quantized
    try:
        from llama_cpp_batched import LlamaCppBatched
    except ImportError as exc:
        print(f"llama.cpp: not measured ({exc})", file=sys.stderr)
    else:
        llama = LlamaCppBatched(path, ns.threads, n_seq_max=1, seq_len=len(prompt) + ns.tokens + 16)
        free = llama.generate([prompt], ns.tokens)[0]
        top1 = llama.top1_along(prompt + reference)[len(prompt) - 1 : -1]
        rows["llama.cpp (llama-cpp-python)"] = compare(reference, {"free": free, "top1": top1})
        llama.close()
    report(rows, f"Greedy agreement with the float32 dequantized model: {Path(path).name}, {ns.tokens} tokens",
           ns.markdown)  # fmt: skip
    return 0


def chat_prompt(tokenizer: Any) -> list[int]:
    """The token ids of ``PROMPT`` in the model's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def report(rows: dict[str, dict[str, float]], title: str, markdown: str | None, column: str = "candidate",
           setting: str = "") -> None:  # fmt: skip
    """Print the table of ``rows`` (``compare``'s) under ``title``, and append it to ``markdown`` when given."""
    lines = [
        *report_header(title, f"python {' '.join(sys.argv)}"),
        f"- Prompt: the chat template around {PROMPT!r}; EOS ignored{setting}",
        "",
        f"| {column} | teacher-forced top-1 agreement | free-running: first divergence | free-running: equal tokens |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        forced = f"{row['teacher_forced']:.1%}" if "teacher_forced" in row else "-"
        lines.append(f"| {name} | {forced} | {row['first_divergence']} | {row['free_equal']:.1%} |")
    table = "\n".join(lines) + "\n\n"
    print(table)
    if markdown:
        with open(markdown, "a") as f:
            f.write(table)


if __name__ == "__main__":
    raise SystemExit(main())
