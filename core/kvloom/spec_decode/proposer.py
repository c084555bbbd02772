"""The speculative-decoding proposer contract: what a proposer declares and does.

A proposer drafts up to ``num_speculative_tokens`` (k) tokens per running request after
each step; the next step's target forward verifies them all, and the rejection sampler
(``kvloom.sample.rejection_sampler``) keeps the target's output distribution exactly,
whatever the drafts are. A proposer can therefore only make decoding faster or slower,
never change what it produces: a bad proposer costs speed, not correctness.

Proposers are plugins (entry-point group ``kvloom.spec_decode_proposers``, entry-point
name == ``NAME``); ``--speculative-config``'s ``method`` picks one by ``NAME`` or one of its
``methods``. kvloom's own (``ngram``, ``draft_model``, ``eagle3``, ``mtp``) implement the same
contract. There are two kinds, and the kind is the proposer's declaration of what it needs:

- ``HostProposer``: drafts on the host from the requests' token ids alone (no model, no
  device memory): ``propose(requests)``. n-gram prompt lookup is one.
- ``ModelProposer``: owns a draft model (``build_draft_model``) that the model runner runs
  for it, with its own KV cache from the same KV-cache manager: every block a request is
  given holds the draft model's KV beside the target's (one block table), and the scheduler
  keeps k slots past each request's computed tokens for the drafts' KV
  (``SpeculativeConfig.num_lookahead_tokens``). It may read the target's hidden states at
  chosen layers (``target_hidden_layers``), which the target model must expose
  (``kvloom.models.interface.supports_hidden_state_taps``). The draft model follows
  ``DraftModel``.

``validate`` turns the declarations into human-readable reasons, as attention backends do;
``kvloom.testing.spec_decode`` checks a proposer against the contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from kvloom.config import EngineConfig, ModelConfig, SpeculativeConfig


@dataclass(frozen=True)
class ProposalRequest:
    """One request a ``HostProposer`` drafts for."""

    req_id: str
    """The request's id (stable while it runs; a preempted request comes back under it)."""
    token_ids: np.ndarray
    """Its known tokens, prompt then output (int64, read-only): the drafts continue them."""
    num_drafts: int
    """The most drafts it takes this step (at most k; fewer near ``max_tokens`` or
    ``max_model_len``). Fewer drafts, or none, are always allowed."""


@dataclass
class Proposals:
    """What a proposer returns for a list of requests, in their order."""

    token_ids: list[list[int]]
    """Per request: its drafts (token ids in the target's vocabulary), at most ``num_drafts``."""
    probs: list[torch.Tensor | None] | None = None
    """Per request, the draft distribution each draft was drawn from (``[len(drafts),
    vocab_size]`` float, rows summing to 1), so that the rejection sampler accepts with
    ``min(1, p/q)``; ``None`` (or a ``None`` entry): the drafts are deterministic (q is
    one-hot on the draft, accepted with probability p(draft))."""


@runtime_checkable
class DraftModel(Protocol):
    """The model a ``ModelProposer`` builds (an ``nn.Module`` of kvloom layers whose
    ``kvloom.attention.layer.Attention`` layers read and write their own KV cache).

    The runner feeds it, for each request, the positions the target computed and kept in a
    step (positions p of ``[start, end)``), then one position per further draft. With
    ``shift_tokens`` (EAGLE, MTP) position p reads the token at p + 1 and the target's
    hidden states at p (``target_hidden_layers``, concatenated in that order); without it
    (an independent draft model) position p reads the token at p, and the fed positions
    also include the newly sampled token. The logits at a request's last fed position give
    its next draft (greedy)."""

    shift_tokens: bool
    """Whether position p reads the token at p + 1 and the target's hidden states at p."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids``/``positions [N]`` and, with ``shift_tokens``, ``hidden_states [N, *]``:
        the target's at the first forward of a step, then what the previous call returned
        as carried. Returns (the hidden states the logits read ``[N, H]``, the hidden states
        carried to the next draft position ``[N, *]`` or None)."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, target vocab_size]`` of the draft's next token at each row."""
        ...


@dataclass
class DraftModelContext:
    """What ``ModelProposer.build_draft_model`` receives from the model runner."""

    config: EngineConfig
    """The engine's config (``config.speculative`` is this run's ``SpeculativeConfig``)."""
    target_model: nn.Module
    """The target model, loaded (a draft may share its embedding or LM head)."""
    device: torch.device
    """The device the draft model runs on."""
    loader: Any = None
    """``load(model_cls, model_config, **kwargs) -> nn.Module``: see ``load``."""

    def load(self, model_cls: type[nn.Module], model_config: ModelConfig, **kwargs: Any) -> nn.Module:
        """``model_cls(draft config, **kwargs)`` built as the engine builds a model (the same
        attention backend, KV-cache dtype, ``max_model_len`` and parallelism; the draft
        config is the engine's with ``model_config`` as its model section) and its
        checkpoint's weights loaded by its ``load_weights`` (random under ``--load-format
        dummy``). A draft sharing the target's embedding or LM head (pass ``context.target_model``
        in ``kwargs``) reports those weights loaded itself."""
        if self.loader is None:
            raise RuntimeError("this DraftModelContext has no loader")
        return self.loader(model_cls, model_config, **kwargs)


class SpecDecodeProposer(ABC):
    """A speculative-decoding proposer (see the module docstring). Subclass
    ``HostProposer`` or ``ModelProposer``, not this class."""

    NAME: ClassVar[str]
    """Its unique name: the entry-point name and a ``method`` of ``--speculative-config``."""
    methods: ClassVar[tuple[str, ...]] = ()
    """Other ``method`` values it serves (vLLM's aliases: ``eagle`` for ``eagle3``)."""
    max_num_speculative_tokens: ClassVar[int | None] = None
    """The largest k it drafts (None: any ``num_speculative_tokens``)."""
    uses_kv_cache: ClassVar[bool] = False
    """Whether it owns a draft model with a KV cache beside the target's (``ModelProposer``)."""

    def __init__(self, config: EngineConfig) -> None:
        """``config``: the engine's, with ``config.speculative`` resolved."""
        assert config.speculative is not None
        self.config = config
        self.speculative: SpeculativeConfig = config.speculative
        self.num_speculative_tokens = config.speculative.num_speculative_tokens

    @classmethod
    def serves(cls, method: str) -> bool:
        """Whether ``method`` (of ``--speculative-config``) names this proposer."""
        return method == cls.NAME or method in cls.methods

    @classmethod
    def validate(cls, speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
        """Every reason it cannot draft for ``config``'s target with ``speculative``; empty
        means it can. Called once, while the engine config is resolved (``speculative``
        is not in ``config`` yet). Override ``extra_validation`` for checks of your own."""
        reasons = []
        k = speculative.num_speculative_tokens
        if cls.max_num_speculative_tokens is not None and k > cls.max_num_speculative_tokens:
            reasons.append(f"num_speculative_tokens {k} is more than it drafts (at most {cls.max_num_speculative_tokens})")
        reasons.extend(cls.extra_validation(speculative, config))
        return reasons

    @classmethod
    def extra_validation(cls, speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
        """Proposer-specific reasons (a missing draft checkpoint, a vocabulary that differs
        from the target's, ...). Default: none."""
        return []

    def remove_requests(self, req_ids: list[str]) -> None:
        """Requests finished or preempted: forget any state kept for them. Default: nothing."""


class HostProposer(SpecDecodeProposer):
    """A proposer that drafts on the host from token ids alone (no model, no KV cache)."""

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> Proposals | list[list[int]]:
        """Drafts for each request of ``requests`` (in order; at most its ``num_drafts``,
        possibly none). Runs once per step on the host, after the step's tokens are known:
        keep it fast (vectorised) for large batches."""


class ModelProposer(SpecDecodeProposer):
    """A proposer whose drafts come from a draft model that the model runner runs for it,
    with its own KV cache from the same KV-cache manager (see the module docstring)."""

    uses_kv_cache: ClassVar[bool] = True

    def target_hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states its draft model reads, by HF's ``output_hidden_states``
        index: ``i`` < num_hidden_layers is the residual stream entering layer ``i`` (0: the
        embeddings), ``num_hidden_layers`` the final normed output. Default: none."""
        return ()

    @abstractmethod
    def build_draft_model(self, context: DraftModelContext) -> nn.Module:
        """Build and load the draft model (a ``DraftModel``) on ``context.device``; called once,
        after the target is loaded and before the KV cache is sized (its attention layers
        are counted in every block)."""
