"""OotTestPlatform: the host CPU again, but out-of-tree and with its own backend priorities.

A real out-of-tree platform describes a new device; this one reuses the CPU so that the
tests can run anywhere. It is available unless KVLOOM_TEST_OOT_PLATFORM_AVAILABLE=0
(so tests can also show the fallback to the built-in platforms).
"""

from __future__ import annotations

import os

import torch

from kvloom.interfaces import BackendCandidate, DeviceCapability, Platform, Worker, WorkerBase

KVLOOM_PLUGIN_API = "1.0"


class OotTestPlatform(Platform):
    name = "oot_test"
    device_type = "cpu"
    builtin = False  # out-of-tree: wins over the built-in platforms when available
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get("KVLOOM_TEST_OOT_PLATFORM_AVAILABLE", "1") != "0"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "KVLOOM_TEST_OOT_PLATFORM_AVAILABLE=0"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "OOT test device"

    @classmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        return [
            BackendCandidate("OOT_TEST_ATTN", "kvloom-test-oot-backend"),
            BackendCandidate("CPU_ATTN", "kvloom-backend-cpu"),
        ]

    @classmethod
    def get_worker_cls(cls) -> type[WorkerBase]:
        return Worker
