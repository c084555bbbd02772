"""The batched sampler: logits [B, V] -> one token per row, plus logprobs on request.

Order of operations (vLLM's):

0. logit_bias: each row's biases are added to its logits;
1. penalties: repetition (on prompt + output tokens), then frequency and presence (on
   output tokens);
2. min_tokens: EOS and stop token ids get -inf until the row has min_tokens outputs;
   then the logits processor plugins, each on the rows that asked for it (``extra_args``);
3. greedy rows: argmax of the processed logits;
4. sampled rows: temperature -> top-k -> top-p -> min-p -> draw.

The draw uses the exponential race: ``argmax(p_i / q_i)`` with ``q_i ~ Exponential(1)``
picks token i with probability ``p_i / sum(p)``, so masked probabilities need no
renormalisation and seeded rows only need their own noise, drawn from their own
generator (reproducible whatever else is in the batch).

Logprobs are taken from the raw model logits (log_softmax before any processing, vLLM's
default "raw_logprobs").

Fast path: a batch of plain temperature sampling (no logprobs, logit_bias, penalties,
min_tokens, top-k/top-p/min-p or seeds; not all greedy) goes to the platform's
``random_sample`` custom op when one is active (``kvloom.layers.custom_ops``): one pass
over the logits in the LM head's dtype instead of the seven float32 passes of the torch
code (``random_sample_torch``), drawing from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.layers.custom_ops import get_custom_op
from kvloom.outputs import TokenLogprobs
from kvloom.logits_processor import LogitsProcessor
from kvloom.sample.metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Logprobs of a batch in compact form; ``to_lists`` converts (one device sync).

    Column 0 is the chosen token, columns 1..N the top-N tokens (N = the batch's max).
    """

    token_ids: torch.Tensor  # [B, N+1] long
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B] long: rank of the chosen token (1 = most likely)

    def to_lists(self, num_logprobs: list[int | None] | int) -> list[TokenLogprobs | None]:
        """One TokenLogprobs per row with that row's own top-N (None where not requested)."""
        rows = self.token_ids.shape[0]
        if isinstance(num_logprobs, int):
            num_logprobs = [num_logprobs] * rows
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(num_logprobs):
            if n is None:
                out.append(None)
                continue
            out.append(
                TokenLogprobs(
                    token_ids=token_ids[i][: n + 1],
                    logprobs=logprobs[i][: n + 1],
                    ranks=[ranks[i]] + list(range(1, n + 1)),
                )
            )
        return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks plus the top-``num_logprobs`` of each row.

    A token's rank counts the tokens at least as likely as it (ties rank below), so the
    most likely token has rank 1.
    """
    token_ids = token_ids.to(torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs >= chosen).sum(dim=1)
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids, chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int) -> list[TokenLogprobs]:
    """Prompt logprobs: row p of ``logits`` predicts ``next_token_ids[p]`` (the prompt token
    after position p). Returns one TokenLogprobs per row (the prompt token first)."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    tensors = gather_logprobs(logprobs, next_token_ids.to(logits.device), num_logprobs)
    return [t for t in tensors.to_lists(num_logprobs) if t is not None]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    #: Compact logprobs of rows that asked for them (None when no row did).
    logprobs_tensors: LogprobsTensors | None
    #: Per row, the top-N requested (None = no logprobs for that row).
    num_logprobs: list[int | None]

    def logprobs_lists(self) -> list[list[TokenLogprobs] | None] | None:
        """The per-request form of ``ModelRunnerOutput.logprobs`` (one entry per sampled token)."""
        if self.logprobs_tensors is None:
            return None
        return [None if t is None else [t] for t in self.logprobs_tensors.to_lists(self.num_logprobs)]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty on tokens seen in the prompt or output (divide positive logits,
    multiply negative ones), then frequency (per occurrence) and presence (once)
    penalties on tokens seen in the output."""
    counts = metadata.output_token_counts
    assert counts is not None and metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    vocab = counts.shape[1]
    if vocab != logits.shape[1]:
        raise ValueError(f"penalties: metadata vocab_size {vocab} != logits width {logits.shape[1]}")
    in_output = counts > 0
    if metadata.prompt_token_mask is not None:
        seen = in_output | metadata.prompt_token_mask
        rep = metadata.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts.to(logits.dtype)
    logits = logits - metadata.presence_penalties.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


#: Candidates examined for top-p before falling back to a full sort of the row: the
#: nucleus of a peaked distribution lies within its few hundred most likely tokens.
TOP_P_CANDIDATES = 256


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (-inf) tokens below each row's k-th largest logit (ties at the boundary stay).
    Rows with ``top_k >= vocab`` are left alone; ``max_top_k`` is the largest enabled k."""
    vocab = logits.shape[1]
    enabled = top_k < vocab
    k = torch.where(enabled, top_k, 1)
    kth = logits.topk(max_top_k, dim=1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill((logits < kth) & enabled.unsqueeze(1), float("-inf"))


def _nucleus_threshold(sorted_logits: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1] smallest logit kept by top-p, from each row's logits sorted descending."""
    probs = (sorted_logits - log_norm).exp()
    mass_before = torch.cumsum(probs, dim=1) - probs
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=1).clamp(min=1)
    return sorted_logits.gather(1, (num_kept - 1).unsqueeze(1))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's nucleus: the smallest set of most likely
    tokens whose probability reaches p (the token that crosses p is kept, and so are
    tokens tied with it). Rows with p = 1 keep everything.

    Only the top ``TOP_P_CANDIDATES`` logits are sorted, unless their mass falls short of
    p; those rows (flat distributions) are sorted in full.
    """
    vocab = logits.shape[1]
    active = top_p < 1.0
    log_norm = torch.logsumexp(logits, dim=1, keepdim=True)
    candidates = logits.topk(min(vocab, TOP_P_CANDIDATES), dim=1).values
    threshold = _nucleus_threshold(candidates, log_norm, top_p)
    candidate_mass = (candidates - log_norm).exp().sum(dim=1)
    short = active & (candidate_mass < top_p)
    # bool() syncs with the device; acceptable once per step (the sampled ids sync anyway).
    if candidates.shape[1] < vocab and bool(short.any()):
        rows = short.nonzero().squeeze(1)
        full = logits[rows].sort(dim=1, descending=True).values
        threshold[rows] = _nucleus_threshold(full, log_norm[rows], top_p[rows])
    drop = (logits < threshold) & active.unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below min_p times the row's largest probability."""
    threshold = min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from (unnormalised) ``probs``; seeded rows use their generator.

    The Exponential(1) noise is ``-log(u)`` with u uniform in [0, 1) (twice as fast as
    ``exponential_`` on CPU). It is never 0 (u < 1), so no 0/0 NaN can win the argmax;
    u = 0 gives infinite noise, which only makes that token lose.
    """
    uniform = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    noise = uniform.log_().neg_()
    return probs.div_(noise).argmax(dim=1)


def random_sample_torch(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
    """The torch code of the ``random_sample`` custom op: what ``Sampler`` computes for a
    batch of plain temperature sampling. ``logits [B, V]`` (any float dtype), ``temperature
    [B]`` float32 (greedy rows hold 1.0), ``greedy [B]`` bool or None (no greedy row) ->
    ``[B]`` int64: ``argmax(logits)`` on greedy rows, else a draw from
    ``softmax(logits / temperature)`` (exponential race, torch's default generator)."""
    logits = logits.to(torch.float32)
    sampled = exponential_race(torch.softmax(logits / temperature.unsqueeze(1), dim=1), {})
    if greedy is None:
        return sampled
    return torch.where(greedy, logits.argmax(dim=1), sampled)


def no_logit_processing(metadata: SamplingMetadata) -> bool:
    """Whether the batch asks for no logprobs and changes no logit (no logit_bias,
    penalties, min_tokens or logits processors): the raw logits decide alone."""
    return (
        metadata.max_num_logprobs is None
        and metadata.logit_bias is None
        and metadata.no_penalties
        and metadata.min_tokens_mask is None
        and metadata.logits_processors is None
    )


def _plain_temperature_batch(metadata: SamplingMetadata) -> bool:
    """Whether the batch is temperature sampling and nothing else (``random_sample``'s
    contract): no logprobs, logit_bias, penalties, min_tokens or truncation, no seeded
    row (its draws must follow its generator, as on the torch path), and some row not
    greedy (an all-greedy batch is one argmax already)."""
    return (
        not metadata.all_greedy
        and no_logit_processing(metadata)
        and metadata.top_k is None
        and metadata.top_p is None
        and metadata.min_p is None
        and not metadata.generators
    )


class Sampler:
    """Samples one token per row of a float logits batch [B, V] (see module docstring).
    ``logits_processors``: the logits processor plugins' instances, by name."""

    def __init__(self, logits_processors: dict[str, LogitsProcessor] | None = None) -> None:
        self.logits_processors = logits_processors or {}

    def _apply_logits_processors(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Each processor changes, in one call, the rows that asked for it."""
        assert metadata.logits_processors is not None
        for name, rows, states in metadata.logits_processors:
            processor = self.logits_processors.get(name)
            if processor is None:
                raise ValueError(f"extra_args.{name}: the logits processor {name!r} is not loaded in the model runner")
            out = processor.apply(logits[rows], states)
            if out.shape != (len(states), logits.shape[1]):
                raise ValueError(f"logits processor {name!r} returned logits of shape {tuple(out.shape)} for "
                                 f"{len(states)} rows of {logits.shape[1]} (expected the shape it was given)")  # fmt: skip
            logits = logits.index_put((rows,), out.to(logits.dtype))
        return logits

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 0-2 of the module docstring, in float32: the logits the rows' tokens are
        chosen from, and the raw logprobs (log_softmax before any processing) when some row
        wants logprobs, else None. The rejection sampler processes each verified position
        with it too."""
        logits = logits.to(torch.float32)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None
        if metadata.logit_bias is not None:
            rows, ids, values = metadata.logit_bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        if metadata.min_tokens_mask is not None:
            logits = logits.index_put(metadata.min_tokens_mask, torch.tensor(float("-inf"), device=logits.device))
        if metadata.logits_processors is not None:
            logits = self._apply_logits_processors(logits, metadata)
        return logits, raw_logprobs

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        random_sample = get_custom_op("random_sample")
        if random_sample is not None and _plain_temperature_batch(metadata):
            # The op reads the logits in the LM head's dtype: no float32 copy first.
            sampled = random_sample(logits, metadata.temperature, metadata.greedy_mask)
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None,  # type: ignore[arg-type]
                                 num_logprobs=list(metadata.num_logprobs))  # fmt: skip
        if metadata.all_greedy and no_logit_processing(metadata):
            # The argmax of the logits as they are: casting to float32 first changes no
            # value's order, it only costs a pass over [batch, vocab].
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=1), logprobs_tensors=None,
                                 num_logprobs=list(metadata.num_logprobs))  # fmt: skip
        logits, raw_logprobs = self.process_logits(logits, metadata)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=1)
        else:
            random_sampled = self._sample_random(logits, metadata)
            if metadata.all_random:
                sampled = random_sampled
            else:
                assert metadata.greedy_mask is not None
                sampled = torch.where(metadata.greedy_mask, logits.argmax(dim=1), random_sampled)

        logprobs_tensors = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs_tensors = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs_tensors,
            num_logprobs=list(metadata.num_logprobs),
        )

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return exponential_race(sampling_probs(logits, metadata), metadata.generators)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The (unnormalised after min-p) distribution the sampled rows draw from:
    temperature -> top-k -> top-p -> softmax -> min-p."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    if metadata.top_p is not None:
        logits = apply_top_p(logits, metadata.top_p)
    probs = torch.softmax(logits, dim=1)
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    return probs
