"""kvloom-kv-p2p between two ``kvloom serve`` instances (a prefill and a decode server, each
its own processes) behind ``kvloom router``: the prefill server's response carries
``kv_transfer_params``, which the router hands to the decode request; the answers are one
plain engine's greedy text and the decode server's /metrics count the pulled tokens as
external prefix-cache hits. The proxy's job is also done by hand once, to see the
prefill server's reply."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import httpx

from kvloom import LLM, SamplingParams
from kvloom.testing.install import KvloomServer
from kvloom.testing.models import random_prompts, tiny_model_dir

BLOCK = 16
PROMPTS = random_prompts(512, lengths=(45, 70, 37), seed=43)


def _complete(server: KvloomServer, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": params}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prefill_server_and_a_decode_server(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kv_port = s.getsockname()[1]
    model = str(tiny_model_dir("llama"))
    args = [model, "--dtype", "float32", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]

    def transfer(role: str) -> list[str]:
        return ["--kv-transfer-config", json.dumps({"kv_connector": "P2pNcclConnector", "kv_role": role,
                                                     "kv_parallel_size": 2, "kv_port": kv_port})]  # fmt: skip

    plain = LLM(model=model, dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK)
    want = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                                           use_tqdm=False)]  # fmt: skip
    plain.llm_engine.shutdown()
    with KvloomServer(args + transfer("kv_producer"), tmp_path) as prefill, \
            KvloomServer(args + transfer("kv_consumer"), tmp_path) as decode:  # fmt: skip
        params = _complete(prefill, PROMPTS[0], 1, {"do_remote_decode": True})["kv_transfer_params"]
        assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == len(PROMPTS[0]) // BLOCK
        got = [_complete(decode, PROMPTS[0], 5, params)["choices"][0]["text"]]
        router_args = ["--prefill", prefill.url, "--decode", decode.url, "--startup-timeout", "10"]
        with KvloomServer(router_args, tmp_path, command=[sys.executable, "-m", "kvloom", "router"]) as router:
            for prompt in PROMPTS[1:]:
                response = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                           "ignore_eos": True})  # fmt: skip
                assert response.status_code == 200, response.text
                got.append(response.json()["choices"][0]["text"])
        refused = httpx.post(decode.url + "/v1/completions", timeout=30, json={
            "prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
        assert refused.status_code == 400 and "do_remote_decode: this is the decode instance" in refused.text
        metrics = httpx.get(decode.url + "/metrics", timeout=10).text
    assert got == want
    hits = re.search(r"^kvloom:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert hits is not None and float(hits.group(1)) == sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
