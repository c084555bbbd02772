"""LoRAManager: the model runner's adapters (loaded, placed in slots, mapped per step).

* ``max_cpu_loras`` adapters stay loaded on the host (an LRU cache; ``add_adapter``
  loads and validates from disk).
* ``max_loras`` device slots (1..max_loras; slot 0 = no adapter) hold the stacked
  matrices of every wrapped projection (``LoRALinear``). An adapter a step needs is
  copied into a free slot, or into the least recently used slot no request of the step
  uses. The scheduler admits at most ``max_loras`` adapters into the running batch, so
  a step never needs more slots than there are.
* ``prepare_step`` turns each scheduled request's ``LoRARequest`` into a slot and the
  slots into a per-token ``LoRAMapping`` that the runner puts into the forward context.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.layers.linear import LinearBase
from kvloom.lora.adapter import SUPPORTED_TARGET_MODULES, LoRAAdapter, LoRAAdapterError, load_adapter
from kvloom.lora.layers import LORA_EXTRA, LoRALinear
from kvloom.lora.ops import LoRAMapping
from kvloom.lora.request import LoRARequest
from kvloom.models.interface import get_packed_modules_mapping

logger = logging.getLogger(__name__)


def _slice_names(module_name: str, module: LinearBase, packed: dict[str, list[str]]) -> list[str] | None:
    """HF module names of a projection's slices, or None if LoRA does not apply to it."""
    parent, _, leaf = module_name.rpartition(".")
    originals = packed.get(leaf, [leaf])
    if len(originals) != len(module.shard_names) or not set(originals) <= set(SUPPORTED_TARGET_MODULES):
        return None
    return [f"{parent}.{o}" if parent else o for o in originals]


def wrap_lora_layers(model: nn.Module, num_slots: int, max_rank: int) -> dict[str, LoRALinear]:
    """Replace every adaptable projection of ``model`` with a ``LoRALinear``; returns
    them by HF slice name (``model.layers.0.self_attn.q_proj`` -> its layer)."""
    packed = get_packed_modules_mapping(model)
    targets: list[tuple[str, LinearBase, list[str]]] = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            names = _slice_names(name, module, packed)
            if names is not None:
                targets.append((name, module, names))
    if not targets:
        raise ValueError(f"LoRA: model {type(model).__name__} has no projections LoRA can adapt "
                         f"({', '.join(SUPPORTED_TARGET_MODULES)})")  # fmt: skip
    by_slice: dict[str, LoRALinear] = {}
    for name, module, names in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = LoRALinear(module, names, num_slots, max_rank)
        setattr(parent, attr, wrapper)
        for slice_name in names:
            by_slice[slice_name] = wrapper
    return by_slice


class LoRAManager:
    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device, max_num_tokens: int) -> None:
        lora = config.lora
        self.max_loras = lora.max_loras
        self.max_cpu_loras = max(lora.max_cpu_loras, lora.max_loras)
        self.max_lora_rank = lora.max_lora_rank
        self.device = device
        self.layers = wrap_lora_layers(model, lora.max_loras + 1, lora.max_lora_rank)
        self._wrappers = list(dict.fromkeys(self.layers.values()))
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: last = most recent
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU order
        self._free_slots = list(range(lora.max_loras, 0, -1))
        self._token_slots = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        logger.info("LoRA enabled: %d projections wrapped, max_loras=%d, max_lora_rank=%d, max_cpu_loras=%d",
                    len(self._wrappers), self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # fmt: skip

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, request: LoRARequest) -> bool:
        """Load and validate an adapter (False if it is loaded already)."""
        if request.lora_int_id in self._adapters:
            self._adapters.move_to_end(request.lora_int_id)
            return False
        adapter = load_adapter(request.lora_int_id, request.lora_name, request.lora_path, self.max_lora_rank)
        unknown = sorted(set(adapter.weights) - set(self.layers))
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {request.lora_name}: it adapts {', '.join(unknown[:5])}"
                f"{' ...' if len(unknown) > 5 else ''}, which this model does not have"
            )
        while len(self._adapters) >= self.max_cpu_loras:
            evicted, _ = self._adapters.popitem(last=False)
            self._free_slot_of(evicted)
            logger.info("LoRA adapter %d evicted from the CPU cache (max_cpu_loras=%d)", evicted, self.max_cpu_loras)
        self._adapters[request.lora_int_id] = adapter
        return True

    def ensure_loaded(self, request: LoRARequest) -> None:
        """Load ``request``'s adapter unless it is loaded (the model runner does this for
        each request of a step before the step, so that an adapter that cannot be loaded
        fails its requests alone). A loaded adapter becomes the most recently used, so
        loading another for the same step does not evict it."""
        self.add_adapter(request)

    def remove_adapter(self, lora_id: int) -> bool:
        self._free_slot_of(lora_id)
        return self._adapters.pop(lora_id, None) is not None

    def list_adapters(self) -> set[int]:
        return set(self._adapters)

    def _free_slot_of(self, lora_id: int) -> None:
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self._wrappers:
                layer.set_slot(slot, None)
            self._free_slots.append(slot)

    def _activate(self, request: LoRARequest, in_use: set[int]) -> int:
        """The slot holding ``request``'s adapter, loading it (from disk, into a slot)
        if needed. ``in_use``: slots other requests of this step already hold."""
        lora_id = request.lora_int_id
        if lora_id not in self._adapters:
            self.add_adapter(request)
        self._adapters.move_to_end(lora_id)
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        if not self._free_slots:
            victim = next((i for i, s in self._slot_of.items() if s not in in_use), None)
            if victim is None:
                raise RuntimeError(
                    f"a step uses more than max_loras={self.max_loras} LoRA adapters "
                    "(the scheduler must not allow this)"
                )
            self._free_slot_of(victim)
        slot = self._free_slots.pop()
        weights = self._adapters[lora_id].weights
        for layer in self._wrappers:
            layer.set_slot(slot, weights)
        self._slot_of[lora_id] = slot
        return slot

    # ------------------------------------------------------------------ per step
    def prepare_step(self, lora_requests: Sequence[LoRARequest | None], query_lens: np.ndarray) -> LoRAMapping:
        """The step's per-token slots (request i has ``query_lens[i]`` tokens)."""
        slots = np.zeros(len(lora_requests), dtype=np.int32)
        in_use: set[int] = set()
        for i, request in enumerate(lora_requests):
            if request is not None:
                slots[i] = self._activate(request, in_use)
                in_use.add(int(slots[i]))
        token_slots = np.repeat(slots, query_lens)
        n = len(token_slots)
        self._token_slots[:n].copy_(torch.from_numpy(token_slots))
        groups = [
            (slot, torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device))
            for slot in sorted(in_use)
        ]
        return LoRAMapping(token_slots=self._token_slots[:n], groups=groups)

    def forward_extras(self, lora_requests: Sequence[LoRARequest | None], query_lens: np.ndarray) -> dict:
        """``set_forward_context`` keyword arguments for a step."""
        return {LORA_EXTRA: self.prepare_step(lora_requests, query_lens)}
