"""Per-step sampling inputs for a batch, as tensors.

The model runner builds one ``SamplingMetadata`` per step from the per-request state of
the rows it samples (row i = request i). Building is cheap when every row is greedy or
plain temperature sampling: the penalty, min-tokens and top-k/top-p/min-p tensors are
only made when some row needs them. A ``reusable`` one serves the next steps of the
same rows unchanged (the runner rebuilds it when its batch changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvloom.logits_processor import LogitsProcessorRow
from kvloom.sample.logits_processors import parse_extra_args
from kvloom.sampling_params import SamplingParams

#: Temperatures below this are greedy (same threshold as ``SamplingParams.greedy``).
GREEDY_TEMPERATURE = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device that samples it.

    The runner makes one when the request is added and keeps it for the request's
    lifetime, so the request's noise stream depends only on its seed and its own
    step count, not on which other requests share its batches.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad_token_lists(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[B, max_len] long tensor of the rows, right-padded with ``pad``. A placeholder (-1:
    a token still in flight under async scheduling, which the runner counts on the
    device) becomes ``pad`` too."""
    width = max(max((len(r) for r in rows), default=0), 1)
    padded = [[t if t >= 0 else pad for t in r] + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long).to(device, non_blocking=True)


def token_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] counts of each token id per row; the pad id ``vocab_size`` is dropped."""
    counts = torch.zeros(padded_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def check_sampling_state(params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                         eos_token_id: int | None) -> None:  # fmt: skip
    """Raise ``ValueError`` if one request's sampling state cannot be built.

    The engine core calls this when a request arrives, after the model-bounded rules
    (``kvloom.model_limits``), so that a request whose parameters would fail in a batch
    is refused alone instead of failing a step: it builds the request's sampling state,
    on the CPU, with the same code as a step (``SamplingMetadata.build``) and a generator
    for its seed.
    """
    try:
        if params.seed is not None:
            make_generator(params.seed % (2**63), "cpu")
        # A prompt of one token stands for the real one: only the penalties' prompt mask
        # reads it, and the token ids were checked against the vocabulary already.
        SamplingMetadata.build(
            params=[params],
            prompt_token_ids=[prompt_token_ids[:1]],
            output_token_ids=[[]],
            generators={},
            vocab_size=vocab_size,
            device="cpu",
            eos_token_ids=[eos_token_id],
        )
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"sampling_params: cannot be sampled with ({type(exc).__name__}: {exc})") from None


@dataclass
class SamplingMetadata:
    """What the sampler needs for one batch. Optional tensors are None when no row uses them."""

    #: [B] float32; greedy rows hold 1.0 here (they are argmaxed, never divided).
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    #: [B] bool, True for greedy rows; None when all rows are greedy or all random.
    greedy_mask: torch.Tensor | None
    #: [B] long, vocab_size where top-k is off; None when no row uses top-k.
    top_k: torch.Tensor | None
    #: [B] float32, 1.0 where top-p is off; None when no row uses top-p.
    top_p: torch.Tensor | None
    #: [B] float32, 0.0 where min-p is off; None when no row uses min-p.
    min_p: torch.Tensor | None
    #: row -> generator of the rows whose request has a seed.
    generators: dict[int, torch.Generator]

    #: [B] float32 penalties; None when no row has any penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    #: [B, V] int32 counts of each token in the output so far (penalties only). Built from
    #: the host's tokens; the runner adds a token still in flight on the device
    #: (``StepSampler``), so the counts are those of synchronous steps.
    output_token_counts: torch.Tensor | None = None
    #: [B, V] bool, token appears in the prompt (repetition penalty only).
    prompt_token_mask: torch.Tensor | None = None

    #: Largest enabled top-k (a Python int, so the sampler needs no device sync).
    max_top_k: int = 0

    #: (rows, token ids) to set to -inf: for rows with fewer than min_tokens outputs, their
    #: stop token ids and, unless ignore_eos, their EOS. None when no row needs it.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    #: (rows, token ids, values) added to the logits (logit_bias); None when no row has any.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    #: Logits processor plugins the rows asked for (``extra_args``): (name, rows [n] long,
    #: the rows as the processor sees them); None when no row asked for one.
    logits_processors: list[tuple[str, torch.Tensor, list[LogitsProcessorRow]]] | None = None

    #: Per row: top-N logprobs requested (0 = only the sampled token), or None.
    num_logprobs: list[int | None] = field(default_factory=list)
    #: max over rows of num_logprobs, or None when no row wants logprobs.
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @property
    def reusable(self) -> bool:
        """Whether these tensors hold for the same rows' later steps too: nothing in them
        depends on the tokens sampled so far (penalties count them; the min-tokens mask
        holds while a row has fewer outputs than ``min_tokens``, and once no row does it
        never comes back, as outputs only grow)."""
        return self.no_penalties and self.min_tokens_mask is None and self.logits_processors is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: list[int | None],
    ) -> "SamplingMetadata":
        """Build the batch's tensors. All lists are indexed by row (request)."""
        batch = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(eos_token_ids) == batch):
            raise ValueError(
                "SamplingMetadata.build: params, prompt_token_ids, output_token_ids and "
                f"eos_token_ids must have one entry per row (got {batch}, {len(prompt_token_ids)}, "
                f"{len(output_token_ids)}, {len(eos_token_ids)})"
            )
        for row in generators:
            if not 0 <= row < batch:
                raise ValueError(f"generators: row {row} is outside the batch (0..{batch - 1})")

        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temperature = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=torch.float32
        ).to(device, non_blocking=True)
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True)

        # Truncation only matters for sampled rows.
        top_k = top_p = min_p = None
        if not all_greedy:
            ks = [p.top_k if (p.top_k > 0 and not g) else vocab_size for g, p in zip(greedy, params)]
            if any(k < vocab_size for k in ks):
                top_k = torch.tensor(ks, dtype=torch.long).to(device, non_blocking=True)
            ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
            if any(p < 1.0 for p in ps):
                top_p = torch.tensor(ps, dtype=torch.float32).to(device, non_blocking=True)
            mps = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
            if any(m > 0.0 for m in mps):
                min_p = torch.tensor(mps, dtype=torch.float32).to(device, non_blocking=True)

        meta = cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
        )

        if any(p.uses_penalties for p in params):
            meta.presence_penalties = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(
                device, non_blocking=True
            )
            meta.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(
                device, non_blocking=True
            )
            meta.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(
                device, non_blocking=True
            )
            meta.output_token_counts = token_counts(_pad_token_lists(output_token_ids, vocab_size, device), vocab_size)
            if any(p.repetition_penalty != 1.0 for p in params):
                meta.prompt_token_mask = token_counts(_pad_token_lists(prompt_token_ids, vocab_size, device), vocab_size) > 0

        if top_k is not None:
            meta.max_top_k = max(k for k in ks if k < vocab_size)

        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if p.min_tokens > 0 and len(out) < p.min_tokens:
                banned = set(p.stop_token_ids)
                if eos is not None and not p.ignore_eos:
                    banned.add(eos)
                for t in sorted(banned):
                    if 0 <= t < vocab_size:
                        banned_rows.append(row)
                        banned_ids.append(t)
        if banned_rows:
            meta.min_tokens_mask = (
                torch.tensor(banned_rows, dtype=torch.long).to(device, non_blocking=True),
                torch.tensor(banned_ids, dtype=torch.long).to(device, non_blocking=True),
            )

        if any(p.logit_bias for p in params):
            bias_rows: list[int] = []
            bias_ids: list[int] = []
            bias_values: list[float] = []
            for row, p in enumerate(params):
                # (The ids are in the vocabulary: the engine core admits no other, see
                # kvloom.model_limits.)
                for token_id, value in (p.logit_bias or {}).items():
                    bias_rows.append(row)
                    bias_ids.append(token_id)
                    bias_values.append(value)
            meta.logit_bias = (
                torch.tensor(bias_rows, dtype=torch.long).to(device, non_blocking=True),
                torch.tensor(bias_ids, dtype=torch.long).to(device, non_blocking=True),
                torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True),
            )

        asked: dict[str, tuple[list[int], list[LogitsProcessorRow]]] = {}
        for row, (p, prompt, out) in enumerate(zip(params, prompt_token_ids, output_token_ids)):
            if p.extra_args:
                for name, args in parse_extra_args(p.extra_args).items():
                    rows, states = asked.setdefault(name, ([], []))
                    rows.append(row)
                    states.append(LogitsProcessorRow(args, prompt, out))
        if asked:
            meta.logits_processors = [
                (name, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), states)
                for name, (rows, states) in asked.items()
            ]

        meta.num_logprobs = [p.logprobs for p in params]
        requested = [n for n in meta.num_logprobs if n is not None]
        meta.max_num_logprobs = max(requested) if requested else None
        return meta
