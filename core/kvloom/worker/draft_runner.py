"""Runs a ``ModelProposer``'s draft model for the model runner: its KV cache lives in the
same blocks as the target's (one block table), so it needs no allocation of its own.

After a step's tokens are known (``StepSpeculation``), ``propose``:

1. feeds the draft model the positions the target computed and kept in the step (request
   by request ``[start, start + kept)``: a prefill chunk, a decode token, or the verified
   positions up to the last accepted one). An independent draft model (``shift_tokens``
   False) reads each position's own token, plus the newly sampled one; EAGLE and MTP
   (``shift_tokens``) read the token after each position and the target's hidden states
   there (``HiddenStateTaps`` of the target). Earlier positions were fed in earlier steps
   (or hold the draft's KV from the prefix cache: a cached block was fed when computed);
2. drafts greedily: the logits at each request's last fed position give its first draft;
   each further draft feeds the previous one (one token per request and forward) until the
   request has its drafts (k, fewer near ``max_model_len``).

A draft model writes KV for positions up to k - 1 past the request's computed tokens: the
scheduler keeps those slots (``SpeculativeConfig.num_lookahead_tokens``). The drafts are
deterministic (argmax), so the rejection sampler verifies them with q one-hot. The draft
model runs eagerly (no CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.config import EngineConfig
from kvloom.forward_context import set_forward_context
from kvloom.models.interface import HiddenStateTaps, enable_hidden_state_taps
from kvloom.spec_decode.proposer import DraftModel, DraftModelContext, ModelProposer
from kvloom.utils import cdiv
from kvloom.worker.input_batch import InputBatch
from kvloom.worker.step_inputs import StepInputs
from kvloom.worker.step_output import UnsampledStep


class DraftRunner:
    """A ``ModelProposer``'s draft model, fed and stepped over the shared KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        proposer: ModelProposer,
        input_batch: InputBatch,
        target_model: nn.Module,
        loader: Callable[..., nn.Module],
    ) -> None:
        self.device = device
        self.input_batch = input_batch
        self.max_model_len = config.model.max_model_len
        model = proposer.build_draft_model(DraftModelContext(config, target_model, device, loader))
        if not isinstance(model, nn.Module) or not isinstance(model, DraftModel):
            raise TypeError(f"proposer {proposer.NAME!r}: build_draft_model returned {type(model).__name__}, not an "
                            "nn.Module with shift_tokens, forward and compute_logits (kvloom.interfaces.DraftModel)")  # fmt: skip
        self.model: Any = model
        self.shift = bool(model.shift_tokens)
        self.attn_layers: list[nn.Module] = [m for m in model.modules() if isinstance(m, (Attention, MLAAttention))]
        if not self.attn_layers:
            raise RuntimeError(f"proposer {proposer.NAME!r}: its draft model has no kvloom Attention layers")
        max_num_reqs = config.scheduler.max_num_seqs
        max_num_tokens = max(config.scheduler.max_num_batched_tokens, max_num_reqs)
        layers = proposer.target_hidden_layers()
        self.taps: HiddenStateTaps | None = enable_hidden_state_taps(target_model, layers, max_num_tokens) \
            if layers else None  # fmt: skip
        # Buffers of its own: the step's are the target's (and a CUDA graph's). A draft model
        # feeds a step's tokens plus each request's newly sampled one.
        block_size = config.cache.block_size
        self.inputs = StepInputs(max_num_tokens + max_num_reqs, max_num_reqs, cdiv(self.max_model_len, block_size),
                                 block_size, device)  # fmt: skip
        self.builder: Any = None  # bound with the KV cache (StepSpeculation.bind_kv_cache)

    def remove_requests(self, req_ids: list[str]) -> None:
        """Nothing per request is kept here (the draft's KV is in the request's blocks)."""

    def _forward(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, ids: np.ndarray,
                 hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        metadata = self.builder.build(self.inputs.prepare_tokens(rows, starts, lens, ids, self.input_batch))
        n = int(lens.sum())
        with set_forward_context(metadata, num_actual_tokens=n):
            return self.model(self.inputs.input_ids[:n], self.inputs.positions[:n], hidden)

    @torch.inference_mode()
    def propose(self, step: UnsampledStep, tokens: list[list[int]], done_prefill: list[bool], wants: list[int],
                room: dict[int, int]) -> list[list[int]]:  # fmt: skip
        """Feed the step's kept positions, then draft for the requests ``wants`` (at most
        ``room[i]`` each); the drafts in ``wants``' order."""
        batch = step.batch
        states, token_ids = batch.states, self.input_batch.token_ids
        num_drafts = [len(d) for d in batch.drafts] if batch.drafts else [0] * len(states)
        step_start = np.concatenate([[0], np.cumsum(batch.query_lens)])
        fed, rows, starts, lens, ids, tap_rows = [], [], [], [], [], []
        for i, s in enumerate(states):
            sampled = bool(tokens[i])
            if done_prefill[i] and not sampled:
                continue  # its sampling failed: nothing after its last position to pair with
            start, query_len = int(batch.seq_lens[i] - batch.query_lens[i]), int(batch.query_lens[i])
            kept = query_len - num_drafts[i] + len(tokens[i]) - 1 if sampled else query_len
            length = kept if self.shift else kept + sampled
            length = min(length, self.max_model_len - start - self.shift)
            if length <= 0:
                continue
            fed.append(i)
            rows.append(s.row)
            starts.append(start)
            lens.append(length)
            ids.append(token_ids[s.row, start + self.shift : start + self.shift + length])
            tap_rows.append(np.arange(step_start[i], step_start[i] + length))
        result: dict[int, list[int]] = {i: [] for i in wants}
        if not fed:
            return [result[i] for i in wants]
        hidden = None
        if self.shift:
            assert self.taps is not None, "a draft model with shift_tokens reads the target's hidden states"
            hidden = self.taps.read(batch.num_tokens)[torch.as_tensor(np.concatenate(tap_rows), device=self.device)]
        lens_np = np.array(lens, dtype=np.int64)
        out, carried = self._forward(np.array(rows), np.array(starts), lens_np, np.concatenate(ids), hidden)
        # Each request's last fed token predicts its first draft.
        drafting = [j for j, i in enumerate(fed) if i in result and room[i] > 0]
        if not drafting:
            return [result[i] for i in wants]
        last = np.cumsum(lens_np) - 1
        pick = torch.as_tensor(last[drafting], device=self.device)
        draft = self.model.compute_logits(out[pick]).argmax(dim=-1).tolist()
        carried = carried[pick] if carried is not None else None
        active = drafting  # indices into fed of the requests still drafting
        positions = np.array(starts)[drafting] + lens_np[drafting]  # where each next draft is fed
        all_rows = np.array(rows)
        while True:
            for j, token_id in zip(active, draft):
                result[fed[j]].append(int(token_id))
            keep = [n for n, j in enumerate(active) if len(result[fed[j]]) < room[fed[j]]]
            if not keep:
                break
            active = [active[n] for n in keep]
            step_ids = np.array([draft[n] for n in keep], dtype=np.int64)
            step_hidden = carried[torch.as_tensor(keep, device=self.device)] if carried is not None else None
            positions = positions[keep]
            out, carried = self._forward(all_rows[active], positions, np.ones(len(active), dtype=np.int64), step_ids,
                                         step_hidden)  # fmt: skip
            positions = positions + 1
            draft = self.model.compute_logits(out).argmax(dim=-1).tolist()
        return [result[i] for i in wants]

    @torch.inference_mode()
    def profile_run(self, make_builder: Callable[[list[nn.Module]], Any], num_tokens: int, num_reqs: int) -> None:
        """A draft forward over ``num_tokens`` tokens (KV writes off) and its logits for
        ``num_reqs`` rows: part of the memory profile."""
        builder, self.builder = self.builder, make_builder(self.attn_layers)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        query_lens[: num_tokens % num_reqs] += 1
        metadata = self.builder.build(self.inputs.dummy_metadata(query_lens, self.max_model_len))
        hidden = self.taps.read(num_tokens) if self.shift and self.taps is not None else None
        with set_forward_context(metadata, num_actual_tokens=num_tokens):
            out, _ = self.model(self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens], hidden)
        self.model.compute_logits(out[:num_reqs])
        self.builder = builder
