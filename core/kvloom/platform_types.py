"""Small value types shared by platforms and attention backends."""

from __future__ import annotations

from typing import NamedTuple


class DeviceCapability(NamedTuple):
    """A CUDA-style compute capability, e.g. ``DeviceCapability(9, 0)`` for Hopper."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def as_int(self) -> int:
        return self.major * 10 + self.minor

    @classmethod
    def parse(cls, text: str) -> "DeviceCapability":
        """Parse "9.0", "90" or "sm90"."""
        t = text.lower().removeprefix("sm").removeprefix("_")
        if "." in t:
            major, minor = t.split(".", 1)
            return cls(int(major), int(minor))
        if not t.isdigit() or len(t) < 2:
            raise ValueError(f"device capability {text!r}: expected forms like 9.0, 90 or sm90")
        return cls(int(t[:-1]), int(t[-1]))
