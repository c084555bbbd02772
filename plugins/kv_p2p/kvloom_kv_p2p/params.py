"""The ``kv_transfer_params`` ``P2pNcclConnector`` reads: checked when a request is added
(a refusal names the key), and the producer's blocks a decode request names, checked
against its own prompt.

The prefill instance takes ``{"do_remote_decode": true}``; the decode instance takes what
the prefill instance answered: ``do_remote_prefill`` (true), ``remote_block_ids`` (its
blocks of the prompt's full blocks, in order), ``remote_request_id``, and, checked when
present, ``remote_host`` / ``remote_port`` (the pair's ``kv_ip`` / ``kv_port``),
``remote_kv_layout`` (the prefill instance's KV layout, which must be ours) and
``remote_block_hash`` (the chained hash of the last of those blocks: the decode request's
prompt must be the prefill request's). Other keys (``remote_engine_id``, vLLM's others)
are carried along unread.
"""

from __future__ import annotations

from typing import Any

#: The most blocks a request may name (more than any context of a served model needs).
MAX_REMOTE_BLOCKS = 1 << 20


def check_params(params: dict[str, Any], transfer: Any, layout: str) -> str | None:
    """Why ``params`` are not ones this instance (``transfer``: its ``KVTransferConfig``)
    takes, or None."""
    producer = transfer.kv_role == "kv_producer"
    if producer and params.get("do_remote_prefill"):
        return ("do_remote_prefill: this is the prefill instance (kv_producer) of P2pNcclConnector; send the decode "
                "request to the decode instance (kv_consumer)")  # fmt: skip
    if not producer and params.get("do_remote_decode"):
        return ("do_remote_decode: this is the decode instance (kv_consumer) of P2pNcclConnector; send the prefill "
                "request to the prefill instance (kv_producer)")  # fmt: skip
    if producer or not params.get("do_remote_prefill"):
        return None
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or len(ids) > MAX_REMOTE_BLOCKS or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):  # fmt: skip
        return (f"remote_block_ids: must be a list of at most {MAX_REMOTE_BLOCKS} block ids (integers >= 0), as the "
                "prefill instance answered them")  # fmt: skip
    if not isinstance(params.get("remote_request_id"), str) or not params["remote_request_id"]:
        return "remote_request_id: required with do_remote_prefill, the prefill instance's id of the request"
    host, port = params.get("remote_host"), params.get("remote_port")
    if (host is not None and host != transfer.kv_ip) or (port is not None and port != transfer.kv_port):
        return (f"remote_host/remote_port: {host}:{port} is not this decode instance's prefill instance "
                f"({transfer.kv_ip}:{transfer.kv_port}, its kv_ip/kv_port): P2pNcclConnector pairs one prefill and "
                "one decode instance")  # fmt: skip
    remote_layout = params.get("remote_kv_layout")
    if remote_layout is not None and remote_layout != layout:
        return (f"remote_kv_layout: the prefill instance's KV layout ({remote_layout}) is not this instance's "
                f"({layout}): serve the same model (and --served-model-name), dtype, KV-cache dtype, block size and "
                "attention backend on both")  # fmt: skip
    block_hash = params.get("remote_block_hash")
    if block_hash is not None and not _is_hex(block_hash):
        return "remote_block_hash: must be the hex string the prefill instance answered"
    return None


def _is_hex(value: Any) -> bool:
    try:
        bytes.fromhex(value)
    except (TypeError, ValueError):
        return False
    return True


def remote_blocks(params: dict[str, Any], block_hashes: list[bytes]) -> list[int]:
    """The producer's block ids of a decode request (its ``kv_transfer_params`` checked by
    ``check_params``); a ``ValueError`` if its prompt is not the one the producer computed
    (``remote_block_hash``), which fails the request."""
    ids: list[int] = params["remote_block_ids"]
    expected = params.get("remote_block_hash")
    if ids and expected is not None:
        ours = block_hashes[len(ids) - 1].hex() if len(block_hashes) >= len(ids) else None
        if ours != expected:
            raise ValueError(f"the prompt is not the one the prefill instance computed (its block {len(ids) - 1} has "
                             "another hash): send the decode instance the prefill request's prompt, with the same "
                             "cache_salt and LoRA adapter")  # fmt: skip
    return ids
