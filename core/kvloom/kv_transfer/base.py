"""The KV-connector contract (vLLM's ``KVConnectorBase_V1``): how an engine hands KV-cache
blocks to something outside its own cache and takes them back.

One connector class runs twice per engine, in two roles (``KVConnectorRole``):

* the **scheduler side**, in the scheduler: when a waiting request is admitted, after the
  local prefix-cache lookup, ``get_num_new_matched_tokens`` says how many more tokens the
  connector can supply and whether they arrive asynchronously; once the scheduler has
  allocated blocks for them, ``update_state_after_alloc`` records where they go. At the end
  of every ``schedule()``, ``build_connector_meta`` turns what the step computes and loads
  (``KVConnectorStep``) into the metadata the worker side receives. ``request_finished``
  is called once when a request ends, before its blocks are freed: returning True keeps
  them until the worker side reports the request in ``finished_sending`` (an
  asynchronous save or send), and the dict returned becomes the request's output
  ``kv_transfer_params`` (how a proxy links a prefill to its decode).
* the **worker side**, beside the model runner: it registers the KV cache
  (``register_kv_caches``), receives each step's metadata (``bind_connector_metadata``),
  starts loading before the forward (``start_load_kv``), waits for each layer's load just
  before that layer's attention (``wait_for_layer_load``), starts saving each layer just
  after its attention wrote it (``save_kv_layer``) and waits for the saves as the step
  ends (``wait_for_save``); ``get_finished`` reports the requests whose asynchronous
  transfers completed, ``get_block_ids_with_load_errors`` the blocks that failed to load.

Blocks are keyed by (KV-cache group, block hash): ``block_key``; a request's chained block
hashes (``KVConnectorRequest.block_hashes``) cover its full blocks, the same in every
engine that serves the same model. Models have one KV-cache group today (group 0); a
connector that can serve several (``supports_hybrid_kv_cache``) gets every group's block
ids, one list per group. A failed load fails that request alone, or its KV is computed
instead (``kv_transfer_config.kv_load_failure_policy``); an exception from a connector
fails the requests it concerns, never the engine. ``docs/kv_connectors.md`` tells the
whole story, with the order of the calls in a step.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvloom.kv_transfer.output import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvloom.config import EngineConfig
    from kvloom.kv_transfer.blocks import KVLayerCache
    from kvloom.kv_transfer.config import KVTransferConfig
    from kvloom.metrics.scheduler_stats import KVTransferStats
    from kvloom.sampling_params import SamplingParams


class KVConnectorRole(enum.Enum):
    """Where a connector instance runs."""

    SCHEDULER = 0
    """In the scheduler (engine core): lookups, allocation, step metadata, request ends."""
    WORKER = 1
    """Beside the model runner: the transfers into and out of the KV cache."""


class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step: a connector subclasses
    it (a dataclass, say) with its own fields. It crosses a process boundary when the
    workers run in their own processes, so it must pickle."""


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: the attention layers that share one block table."""

    layer_names: tuple[str, ...]
    """Its layers' names (``KVLayerCache.name``); empty on the scheduler side, which holds no layers."""
    block_size: int
    """Tokens per block."""


class KVConnectorRequest(Protocol):
    """The request as a connector sees it (the engine's request, read-only)."""

    request_id: str
    """The engine's id of the request (unique while it runs)."""
    prompt_token_ids: list[int]
    """Its prompt."""
    all_token_ids: list[int]
    """Prompt and output tokens so far."""
    num_computed_tokens: int
    """Tokens whose KV is in the cache (the scheduler's count; for a request being admitted,
    0 or the tokens it held before)."""
    block_hashes: list[bytes]
    """The chained hash of each full block of ``all_token_ids`` (group 0's), as far as the
    tokens are known: ``block_key(group, block_hashes[i])`` names block ``i``."""
    kv_transfer_params: dict[str, Any] | None
    """The request's ``kv_transfer_params`` (``SamplingParams.kv_transfer_params``): what a
    proxy passes between engines, e.g. ``{"do_remote_decode": true}``."""
    sampling_params: SamplingParams | None
    """Its sampling parameters (None for pooling)."""

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""

    @property
    def num_prompt_tokens(self) -> int:
        """``len(prompt_token_ids)``."""


class ScheduledKVRequest:
    """One request of a step, as ``build_connector_meta`` sees it."""

    __slots__ = ("_block_ids", "is_new", "num_computed_tokens", "num_scheduled_tokens", "request")

    def __init__(
        self,
        request: KVConnectorRequest,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        is_new: bool,
        block_ids: Callable[[], tuple[list[int], ...]],
    ) -> None:
        self.request = request
        """The request."""
        self.num_computed_tokens = num_computed_tokens
        """Tokens whose KV is in the cache before this step (local prefix hits and the
        connector's tokens included): the step computes the next ``num_scheduled_tokens``."""
        self.num_scheduled_tokens = num_scheduled_tokens
        """Tokens the step computes for it."""
        self.is_new = is_new
        """Whether it starts (or restarts after a preemption) in this step."""
        self._block_ids = block_ids

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        """Its block table, one list of block ids per KV-cache group (computed on first use)."""
        return self._block_ids()

    @property
    def num_tokens_after_step(self) -> int:
        """Tokens whose KV is in the cache once the step ran."""
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass
class KVConnectorStep:
    """What one ``schedule()`` decided, for ``build_connector_meta``."""

    requests: list[ScheduledKVRequest]
    """The requests the step computes tokens for."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished, aborted or preempted since the last step (their blocks may be
    reused from this step on, except those ``request_finished`` kept)."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """The preempted ones among them (they come back later as new requests)."""


class KVConnectorBase(ABC):
    """A KV connector (vLLM's ``KVConnectorBase_V1``): see the module docstring.

    A plugin registers the class in the ``kvloom.kv_connectors`` entry-point group under
    its ``NAME`` (``kv_transfer_config.kv_connector`` selects it). kvloom builds one
    instance per role: ``cls(config, role, kv_cache_groups)``. The methods of the other role
    are never called on an instance. Every method may raise: the engine fails the requests
    concerned (``docs/kv_connectors.md``, "When a connector fails")."""

    NAME: ClassVar[str]
    """The connector's name (vLLM's, for the connectors vLLM has): the entry-point name."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Old names that still select it, with a deprecation warning (e.g. ``SharedStorageConnector``)."""
    supports_hybrid_kv_cache: ClassVar[bool] = False
    """Whether it serves models of several KV-cache groups (vLLM's ``SupportsHMA``); one that
    does not refuses such a model with a reason naming it."""
    extra_config_keys: ClassVar[tuple[str, ...]] = ()
    """The ``kv_connector_extra_config`` keys it reads; another key is an error naming it."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_groups: tuple[KVCacheGroupSpec, ...]) -> None:
        self.config = config
        """The engine's config (``config.kv_transfer`` is the ``KVTransferConfig``)."""
        self.role = role
        """Which side this instance is."""
        self.kv_cache_groups = kv_cache_groups
        """The model's KV-cache groups (one today)."""
        self._metadata: KVConnectorMetadata | None = None

    @property
    def transfer_config(self) -> KVTransferConfig:
        """``config.kv_transfer``: role, extra config, rendezvous address."""
        assert self.config.kv_transfer is not None
        return self.config.kv_transfer

    @classmethod
    def validate_config(cls, config: EngineConfig) -> list[str]:
        """Why this connector cannot run ``config`` (human-readable reasons; none: it can).
        Checked when the engine config is resolved, before the model loads. The default
        checks the extra config's keys against ``extra_config_keys``."""
        assert config.kv_transfer is not None
        unknown = sorted(set(config.kv_transfer.kv_connector_extra_config) - set(cls.extra_config_keys))
        if unknown:
            allowed = ", ".join(cls.extra_config_keys) or "none"
            return [f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} (allowed: {allowed})"]
        return []

    # ------------------------------------------------------------------ scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens after the first ``num_computed_tokens`` (those the local prefix
        cache holds) the connector can supply, and whether they arrive asynchronously
        (the request then waits, ``WAITING_FOR_REMOTE_KVS``, while other requests run).
        ``(None, False)``: ask again in a later step. Count only whole blocks that are
        available now, and at most ``request.num_tokens - 1 - num_computed_tokens`` (one
        token is always computed). May be called several times for a request: no side
        effects."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: KVConnectorRequest, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """The scheduler allocated the request's blocks (``block_ids``: its whole block
        table, one list per KV-cache group); the tokens ``request.num_computed_tokens``
        (its local prefix-cache hits) .. ``+ num_external_tokens`` are to be loaded into
        them (0: nothing to load). Called for every admitted request, loading or not."""

    @abstractmethod
    def build_connector_meta(self, step: KVConnectorStep) -> KVConnectorMetadata:
        """The worker side's metadata for this step; resets what it recorded for the
        step. Must not change ``step``."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker side reported after a step (finished transfers, failed blocks)."""

    def request_finished(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends (finished, aborted or failed), before its blocks
        are freed: ``(True, ...)`` keeps them until the worker side lists the request in
        ``finished_sending``; the dict, if any, is the request's output ``kv_transfer_params``."""
        return False, None

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> str | None:
        """Why a request's ``kv_transfer_params`` are not ones this connector takes (the
        request is refused with it), or None. Default: any params."""
        return None

    def take_stats(self) -> KVTransferStats | None:
        """The scheduler side's counts since the last call (e.g. ``hits_by_tier``), or None."""
        return None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, KVLayerCache]) -> None:
        """The KV cache, by layer name, once it is allocated (before any step)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """This step's metadata from the scheduler side (before ``start_load_kv``)."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """The step is over (after ``get_finished``)."""
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        """The metadata of the step in progress (None between steps, or if the scheduler
        side failed to build it: then do nothing)."""
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads, before the forward (also on steps that compute nothing,
        so that asynchronous loads proceed)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's loads of this step are in its cache (on a GPU: make the
        compute stream wait for them), just before its attention runs."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving what this step wrote into the layer's cache (``kv_layer``), just
        after its attention ran. ``attn_metadata``: the step's attention metadata (None
        when the step ran as a CUDA graph, whose layers are saved after it)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the blocks they read (the forward
        has ended; later steps may overwrite them)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(sending, recving)``: requests whose asynchronous saves/sends (kept by
        ``request_finished``) and loads completed since the last call. Every asynchronous
        load is reported once, also when it failed (its blocks then in
        ``get_block_ids_with_load_errors``). ``finished_req_ids``: the requests the
        scheduler finished since the last step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids that failed to load since the last call (synchronous loads:
        in the step that loaded them; asynchronous: no later than the ``get_finished``
        that reports the request)."""
        return set()

    def get_stats(self) -> KVTransferStats | None:
        """The worker side's counts since the last call (``transfers``), or None."""
        return None

    def shutdown(self) -> None:
        """Release what the connector holds (threads, sockets, memory); idempotent."""
