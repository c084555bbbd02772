"""A fake model runner that really uses the paged KV cache, and the helpers that drive it.

``FakeModelRunner`` plays the worker's part of the step contract: it keeps its own copy of
every request (tokens, block table, computed count) from SchedulerOutput diffs, writes
each scheduled token into a simulated KV cache at the slot ``compute_slot_mapping``
gives, and "attends" by reading the whole sequence back from the cache through the
block table. Its next token is a deterministic function of the token history it read,
so a wrong block table, a stale prefix-cache hit or a lost block changes the output
and the result no longer matches ``reference_generate``.

Hybrid layouts (``windows``: one entry per KV-cache group, None for full attention, W for
a sliding window of W positions): each group keeps its own block table and the runner
writes every token into every group's blocks; a group "attends" to what its layers would
read (the whole history, or the last W positions, read back through its table), and the
next token is a function of all of them (``fake_next_token_of``). A window block given
back too early (and reused) or a wrong hit in any group then changes the output.

``compute_slot_mapping`` is the slot rule written the plain way, one position at a time:
an oracle for the model runner's vectorised slot mapping and the scheduler's block tables.
``step`` runs one scheduler step with a runner that samples a fixed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvloom.outputs import EngineCoreOutputs, ModelRunnerOutput

from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.output import SchedulerOutput
from kvloom.scheduler.scheduler import Scheduler


def compute_slot_mapping(block_ids: Sequence[int], start_pos: int, num_tokens: int, block_size: int) -> list[int]:
    """Physical slots of positions ``start_pos .. start_pos + num_tokens - 1`` of a request.

    Position ``p`` lives in the request's block ``p // block_size`` at offset
    ``p % block_size``, so its slot is ``block_ids[p // block_size] * block_size +
    p % block_size``. Example (block size 4): blocks ``[3, 4]``, positions 0..6 ->
    ``[12, 13, 14, 15, 16, 17, 18]``.
    """
    if start_pos < 0 or num_tokens < 0:
        raise ValueError(f"start_pos ({start_pos}) and num_tokens ({num_tokens}) must be >= 0")
    end = start_pos + num_tokens
    if end > len(block_ids) * block_size:
        raise ValueError(
            f"positions up to {end - 1} need {-(-end // block_size)} blocks of size {block_size}, "
            f"but the block table has {len(block_ids)}"
        )
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start_pos, end)]


VOCAB = 23


class _KVCacheProposer:
    """Stands in for a proposer with a KV cache of its own (lookahead slots)."""

    uses_kv_cache = True


def speculative_config(num_speculative_tokens: int, lookahead: bool = False) -> SpeculativeConfig:
    """A resolved ``SpeculativeConfig`` for scheduler tests that set drafts themselves; with
    ``lookahead`` the scheduler also keeps k slots per request for a draft model's KV."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens)
    config.proposer = _KVCacheProposer if lookahead else None
    return config


def fake_next_token(history: list[int]) -> int:
    """Deterministic in the whole token history (order and position matter)."""
    h = len(history)
    for i, t in enumerate(history):
        h = (h * 1_000_003 + (i + 1) * (t + 7)) % 2_147_483_647
    return h % VOCAB


def fake_next_token_of(history: list[int], windows: Sequence[int | None] = (None,)) -> int:
    """The next token of a model whose KV-cache groups see ``history`` through ``windows``."""
    if tuple(windows) == (None,):
        return fake_next_token(history)
    seen: list[int] = []
    for window in windows:
        seen += history if window is None else history[-window:]
    return fake_next_token(seen)


@dataclass
class _RunnerRequest:
    tokens: list[int]
    block_ids: list[list[int]]  # per group
    num_computed: int
    drafts: list[int] = field(default_factory=list)


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None] = (None,)) -> None:
        self.windows = tuple(windows)
        self.block_size = block_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.state: dict[str, _RunnerRequest] = {}
        self.pooling: set[str] = set()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.state.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.state, f"{new.req_id} sent as new while the runner still has it"
            assert len(new.block_ids) == len(self.windows), (new.req_id, len(new.block_ids))
            self.state[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids, [list(g) for g in new.block_ids], new.num_computed_tokens
            )
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        for cached in so.scheduled_cached_reqs:
            st = self.state[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens, (cached.req_id, st.num_computed)
            if cached.num_kept_blocks is not None:  # rejected drafts' blocks went back to the pool
                for table in st.block_ids:
                    assert cached.num_kept_blocks <= len(table)
                    del table[cached.num_kept_blocks :]
            for table, new_ids in zip(st.block_ids, cached.new_block_ids, strict=True):
                table.extend(new_ids)

        # Write K/V of every scheduled token first (as every layer does before attention).
        bs = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.state[req_id]
            st.drafts = list(so.scheduled_spec_decode_tokens.get(req_id, []))
            seq = st.tokens + st.drafts
            assert st.num_computed + n <= len(seq), (req_id, st.num_computed, n, len(seq))
            for table in st.block_ids:
                for pos, slot in zip(
                    range(st.num_computed, st.num_computed + n), compute_slot_mapping(table, st.num_computed, n, bs)
                ):
                    self.kv[slot] = seq[pos]

        req_ids, sampled, pooled = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.state[req_id]
            st.num_computed += n
            req_ids.append(req_id)
            if st.num_computed < len(st.tokens):  # still prefilling
                sampled.append([])
                pooled.append(None)
                continue
            if req_id in self.pooling:
                sampled.append([])
                pooled.append(torch.tensor([float(self._next_token(st, st.num_computed))]))
                continue
            # Verify drafts: accept while they match what the model would produce.
            accepted = []
            base = len(st.tokens)
            for j in range(len(st.drafts) + 1):
                token = self._next_token(st, base + j)
                accepted.append(token)
                if j == len(st.drafts) or st.drafts[j] != token:
                    break
            st.tokens.extend(accepted)
            st.num_computed = len(st.tokens) - 1
            sampled.append(accepted)
            pooled.append(None)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, pooler_output=pooled)

    def _next_token(self, st: _RunnerRequest, length: int) -> int:
        """The next token after the first ``length`` positions, from what each group reads."""
        seen: list[int] = []
        for table, window in zip(st.block_ids, self.windows):
            start = 0 if window is None else max(0, length - window)
            slots = compute_slot_mapping(table, 0, length, self.block_size)[start:]
            seen += [self.kv[s] for s in slots]  # type: ignore[misc]
        return fake_next_token(seen)


def reference_generate(
    prompt: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    max_model_len: int,
    windows: Sequence[int | None] = (None,),
) -> tuple[list[int], str]:
    """Greedy generation with the fake model and the documented stop rules."""
    tokens, out = list(prompt), []
    while True:
        token = fake_next_token_of(tokens, windows)
        tokens.append(token)
        out.append(token)
        if len(out) >= params.min_tokens:
            if token == eos_token_id and not params.ignore_eos:
                return out, "stop"
            if token in params.stop_token_ids:
                return out, "stop"
        if len(tokens) >= max_model_len or (params.max_tokens is not None and len(out) >= params.max_tokens):
            return out, "length"


def make_configs(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
) -> tuple[SchedulerConfig, CacheConfig]:
    return (
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,
        ),
        CacheConfig(
            block_size=block_size,
            user_specified_block_size=True,
            gpu_memory_utilization=0.9,
            kv_cache_memory=None,
            num_gpu_blocks_override=None,
            cache_dtype="auto",
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=hash_algo,
        ),
    )


def run_to_completion(
    scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Step until nothing is left; the output tokens per request id."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return tokens
        so = scheduler.schedule()
        out = scheduler.update_from_output(so, runner.execute_model(so))
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not done after {max_steps} steps")


def sample(scheduler: Scheduler, so: SchedulerOutput, tokens: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    """What a runner returns: one token (7 unless given) for requests whose prompt is done."""
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        req_ids.append(req_id)
        sampled.append((tokens or {}).get(req_id, [7]) if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler, tokens: dict[str, list[int]] | None = None) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, sample(scheduler, so, tokens))
