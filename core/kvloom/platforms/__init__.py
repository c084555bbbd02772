"""Platforms: the contract (``interface``) and which installed platform is active
(``resolution``). The platforms themselves are plugins (``platforms/`` in the repository)."""

from kvloom.platforms.interface import BackendCandidate, DeviceCapability, Platform

__all__ = ["BackendCandidate", "DeviceCapability", "Platform"]
