"""HF transformers as the reference of a quantized checkpoint: its dequantized weights,
with the activations quantized as the method's kernels quantize them.

transformers dequantizes fp8 and compressed-tensors checkpoints when it loads them on a
machine without a GPU (``dequantize=True``), but then runs the float weights on float
activations. A W8A8 method's tokens are those of the same weights with every quantized
GEMM's input quantized: ``inputs_quantized(model, fn)`` does that to an HF model,
``hf_logits_quantized`` gives its logits over whole sequences, and
``assert_greedy_matches_reference`` holds kvloom's greedy tokens to them. ``reference_fp8`` is the fp8 (e4m3)
activation quantization, written independently of any method's code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvloom.testing.models import load_hf_model

__all__ = ["assert_greedy_matches_reference", "hf_logits_quantized", "inputs_quantized", "reference_fp8"]

_E4M3_MAX = 448.0


def reference_fp8(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """``x`` quantized to fp8 e4m3 and back, in its dtype: one scale ``amax / 448`` per
    row, or per row and ``group`` consecutive features (the last dim divisible by it)."""
    rows = x.float().reshape(*x.shape[:-1], -1, group) if group else x.float().unsqueeze(-2)
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / _E4M3_MAX
    out = (rows / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return out.reshape(x.shape).to(x.dtype)


@contextmanager
def inputs_quantized(
    model: torch.nn.Module, quantize: Callable[[torch.Tensor], torch.Tensor], skip: Sequence[str] = ()
) -> Iterator[None]:
    """Inside the block, the input of every projection of HF ``model`` (``nn.Linear``
    modules named ``*_proj``, except those whose name contains one of ``skip``) and of
    every expert GEMM (``F.linear`` calls inside modules named ``*experts``: load the model
    with ``experts_implementation="eager"``) goes through ``quantize``."""
    handles = []
    original = torch.nn.functional.linear

    def quantized_linear(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return original(quantize(x), *args, **kwargs)

    def patch(module: torch.nn.Module, args: Any) -> None:
        torch.nn.functional.linear = quantized_linear

    def restore(module: torch.nn.Module, args: Any, out: Any) -> None:
        torch.nn.functional.linear = original

    for name, module in model.named_modules():
        if any(s in name for s in skip):
            continue
        if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, a: (quantize(a[0]), *a[1:])))
        elif name.endswith("experts"):
            handles += [module.register_forward_pre_hook(patch), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        torch.nn.functional.linear = original
        for handle in handles:
            handle.remove()


def hf_logits_quantized(
    model_dir: str | Path, sequences: Sequence[Sequence[int]], quantize: Callable[[torch.Tensor], torch.Tensor],
    **from_pretrained: Any,
) -> list[torch.Tensor]:  # fmt: skip
    """HF transformers' float32 logits ``[len(seq), vocab]`` of each whole sequence (eager
    attention and experts) with the projections' inputs through ``quantize``
    (``inputs_quantized``); ``from_pretrained`` kwargs go to the loader (a quantization
    config that dequantizes)."""
    model = load_hf_model(model_dir, experts_implementation="eager", **from_pretrained)
    with torch.no_grad(), inputs_quantized(model, quantize):
        return [model(torch.tensor([list(seq)])).logits[0].float() for seq in sequences]


def assert_greedy_matches_reference(
    prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]], reference: Sequence[torch.Tensor],
    margin: float = 0.1,
) -> None:  # fmt: skip
    """Each generated token (kvloom's greedy continuation of its prompt) is the reference's
    greedy choice at its position, the reference's logits computed over prompt + the
    tokens generated before it (``hf_logits_quantized`` of the sequences), or within
    ``margin`` of that choice's logit: activation quantization is discontinuous, so a
    one-ulp difference before a quantizer (another summation order) can move a logit by
    a few hundredths and swap two near-tied tokens, which then changes every later token
    of a whole-token comparison. A wrong weight or scale moves logits by whole units."""
    for prompt, tokens, logits in zip(prompts, generated, reference):
        for j, token in enumerate(tokens):
            row = logits[len(prompt) + j - 1]
            best = int(row.argmax())
            gap = float(row[best] - row[token])
            assert gap <= margin, (f"generated token {j} of prompt {list(prompt)[:6]}...: {token} is {gap:.3g} below "
                                   f"the reference's choice {best} (allowed: {margin})")  # fmt: skip
