"""kvloom-kv-offload: the conformance kit (host tier, host and disk tiers), and an engine
whose device block pool is smaller than its prompts' prefixes: a second pass over the
prompts finds the prefixes the device evicted in the host tier (counted), with the
tokens of an engine without it.

On a CUDA machine (``bash tests/gpu/run.sh offload``) the same tests run on the GPU: the
kit's cache and the engine's are device memory, the host tier pinned, the copies on their
own streams; the transfers' bandwidth goes to ``$OUT/kv_offload.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.interfaces import KVTransferStats
from kvloom.testing.kv_connector import check_kv_connector
from kvloom.testing.models import random_prompts, tiny_model_dir

BLOCK = 16
BLOCK_BYTES = 8192  # the tiny Llama's block: 2 layers x K and V x 16 tokens x 4 heads x 8 x fp32
DEVICE_BLOCKS = 24  # fewer than the prompts' blocks: the first prompts' prefixes are evicted
PROMPTS = random_prompts(512, lengths=(70, 66, 80, 50, 64, 75, 90, 40), seed=11)


def _offload(num_cpu_blocks: int, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks, **extra}}  # fmt: skip


def test_conformance(tmp_path: Path) -> None:
    assert check_kv_connector(_offload(64)) == []
    # Four host slots: most blocks go on to disk and come back from there.
    disk = _offload(4, disk_path=str(tmp_path), disk_bytes_to_use=64 * BLOCK_BYTES)
    assert check_kv_connector(disk, num_requests=4) == []


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        check_kv_connector(_offload(8, eviction_policy="lfu"))
    with pytest.raises(ValueError, match="disk_path and disk_bytes_to_use go together"):
        check_kv_connector(_offload(8, disk_bytes_to_use=2**20))
    with pytest.raises(ValueError, match="holds no KV-cache block"):
        check_kv_connector({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"cpu_bytes_to_use": 100}})  # fmt: skip


def test_a_host_tier_beyond_the_hosts_available_memory_is_refused(monkeypatch) -> None:
    from kvloom_kv_offload import connector

    monkeypatch.setattr(connector, "available_host_memory", lambda: 10 * BLOCK_BYTES)
    with pytest.raises(ValueError, match=r"--kv-offloading-size\): the host tier needs 0\.0 GiB, the host has "
                                         r"0\.0 GiB available"):  # fmt: skip
        check_kv_connector(_offload(11))
    assert check_kv_connector(_offload(10)) == []
    monkeypatch.undo()
    assert connector.available_host_memory() > 0


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls (success: 0)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_pinned_empty_registers_exactly_its_bytes_and_unregisters_when_freed(monkeypatch) -> None:
    """Not torch's pin_memory=True (rounded up to a power of two): 3 MiB + 8 bytes stay that."""
    import gc

    from kvloom_kv_offload.transfers import pinned_empty

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None if res == 0 else pytest.fail(f"error {res}"))
    t = pinned_empty((3 * 2**20 + 8,), torch.uint8)
    ptr = t.data_ptr()
    assert fake.registered == {ptr: 3 * 2**20 + 8} and fake.unregistered == []
    del t
    gc.collect()
    assert fake.unregistered == [ptr]


def _llm(**kwargs: Any) -> Any:
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        return LLM(model=str(tiny_model_dir("llama")), dtype="float32", num_gpu_blocks_override=DEVICE_BLOCKS,
                   block_size=BLOCK, max_model_len=128, **kwargs)  # fmt: skip


def _two_passes(llm: Any) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of both passes over the prompts (one request at a time, so that each
    pass evicts the first prompts' blocks from the device), and the second pass's cached
    tokens per prompt."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens, cached = [], []
    for second in (False, True):
        for prompt in PROMPTS:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            tokens.append(out.outputs[0].token_ids)
            if second:
                cached.append(out.num_cached_tokens)
    return tokens, cached


def test_prefixes_evicted_from_the_device_come_back_from_the_host_tier() -> None:
    want, device_only = _two_passes(_llm())
    assert device_only[0] == 0  # the device evicted the first prompt's prefix
    llm = _llm(kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    connector = llm.llm_engine.engine_core.core.scheduler.kv_connector
    stats, take = KVTransferStats(), connector.take_stats
    with mock.patch.object(connector, "take_stats", lambda: stats.merge(take())):  # the engine's stats, summed
        got, cached = _two_passes(llm)
        stats.merge(take())
    assert got == want
    assert cached == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    from_host = sum(c - d for c, d in zip(cached, device_only))
    assert from_host > 0 and stats.hits_by_tier.get("cpu") == from_host
    kinds = ("CPU_to_GPU", "GPU_to_CPU") if torch.cuda.is_available() else ("host_to_device", "device_to_host")
    loaded, stored = (stats.transfers[kind] for kind in kinds)
    assert loaded.blocks == from_host // BLOCK and loaded.bytes == loaded.blocks * BLOCK_BYTES
    # Every full block of the first pass was stored once (the second pass finds them all).
    assert stored.blocks == sum((len(p) + 3) // BLOCK for p in PROMPTS)
    if os.environ.get("OUT"):  # the GPU stage's record: transfer bandwidth per direction
        with open(Path(os.environ["OUT"]) / "kv_offload.jsonl", "a") as f:
            f.writelines(json.dumps({"transfer": kind, "blocks": c.blocks, "bytes": c.bytes, "seconds": c.seconds,
                                     "GB_per_s": c.bytes / c.seconds / 1e9 if c.seconds else None}) + "\n"
                         for kind, c in stats.transfers.items())  # fmt: skip
