"""Where offloaded blocks are: the host tier's slots and the disk tier's files, each an LRU
map from block key, kept by the connector's scheduler side.

The host tier is a fixed number of slots (the worker side's pinned buffer holds them). A
block stored there gets a free slot, or evicts the least recently used block; with a disk
tier the evicted block moves to disk (a *spill*: the worker writes the slot to a file
before it is reused), and the disk tier evicts its own least recently used file when it
is full. A hit moves a block to the most recently used end.

Slots are handed out lowest first, so that blocks stored together sit in runs of slots
and move in few large copies.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Placement:
    """What storing some blocks took: their slots, and what they pushed down a tier."""

    slots: list[int] = field(default_factory=list)
    """The host slot of each stored block (in order)."""
    spills: list[tuple[int, str]] = field(default_factory=list)
    """(slot, key) of host blocks to write to disk before their slot is reused."""
    disk_drops: list[str] = field(default_factory=list)
    """Keys of disk blocks to delete (evicted from the disk tier)."""


class HostIndex:
    """The host tier (``num_slots`` slots) and an optional disk tier (``disk_blocks`` files)."""

    def __init__(self, num_slots: int, disk_blocks: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier holds no block (num_slots={num_slots})")
        self.num_slots = num_slots
        self.disk_blocks = disk_blocks
        self.host: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self.disk: OrderedDict[str, None] = OrderedDict()  # keys on disk, least recently used first
        self._free = list(range(num_slots))  # a heap: lowest slot first

    def tier_of(self, key: str) -> str | None:
        """``"cpu"``, ``"disk"`` or None (not offloaded)."""
        if key in self.host:
            return "cpu"
        if key in self.disk:
            return "disk"
        return None

    def touch(self, key: str) -> None:
        """A hit: the block becomes the most recently used of its tier."""
        if key in self.host:
            self.host.move_to_end(key)
        elif key in self.disk:
            self.disk.move_to_end(key)

    def slot_of(self, key: str) -> int:
        return self.host[key]

    def store(self, keys: list[str]) -> Placement:
        """Give each key (none of them in the host tier) a slot, evicting as needed; keys
        that were on disk stay there too (their file still holds the block)."""
        placement = Placement()
        for key in keys:
            if not self._free:
                self._evict_one(placement)
            slot = heapq.heappop(self._free)
            self.host[key] = slot
            placement.slots.append(slot)
        return placement

    def _evict_one(self, placement: Placement) -> None:
        key, slot = self.host.popitem(last=False)
        heapq.heappush(self._free, slot)
        if not self.disk_blocks or key in self.disk:
            return
        if len(self.disk) >= self.disk_blocks:
            dropped, _ = self.disk.popitem(last=False)
            placement.disk_drops.append(dropped)
        self.disk[key] = None
        placement.spills.append((slot, key))
