"""Chained block hashes for prefix caching.

A full block of ``block_size`` tokens is identified by
``hash((parent_block_hash, block_token_ids, extra_keys))``: the parent hash makes the
hash cover the whole prefix, the token ids guard against collisions, and the extra keys
(LoRA adapter id and ``cache_salt``, first block only: the chain carries them to every
later block) keep requests that must not share KV apart. The first block's parent is
``None``, so hashes do not depend on the process.

Algorithms (``--prefix-caching-hash-algo``):

* ``sha256`` (default): SHA-256 of the pickled tuple. Fast and collision resistant, but
  pickle's bytes may change across Python versions.
* ``sha256_cbor``: SHA-256 of canonical CBOR (cbor2), reproducible across processes,
  Python versions and languages.
* ``xxhash``: 128-bit xxHash3 of the pickled tuple; fastest, not cryptographic (the
  collision risk is theoretical, but it matters for multi-tenant isolation). Needs the
  optional ``xxhash`` package (``pip install kvloom[xxhash]``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.request import Request

BlockHash = bytes
HashFunction = Callable[[Any], BlockHash]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash")


def sha256_pickle(obj: Any) -> BlockHash:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> BlockHash:
    import cbor2  # only this algorithm needs it (a cached module lookup after the first call)

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_128() -> HashFunction:
    try:
        import xxhash
    except ImportError as e:
        raise ImportError(
            "prefix_caching_hash_algo='xxhash' needs the xxhash package: pip install 'kvloom[xxhash]'"
        ) from e

    def xxhash_128(obj: Any) -> BlockHash:
        return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    return xxhash_128


def get_hash_function(algo: str) -> HashFunction:
    if algo == "sha256":
        return sha256_pickle
    if algo == "sha256_cbor":
        return sha256_cbor
    if algo == "xxhash":
        return _xxhash_128()
    raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}; got {algo!r}")


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    return hash_fn((parent_block_hash, tuple(block_token_ids), extra_keys))


def first_block_extra_keys(request: "Request") -> tuple[Any, ...] | None:
    """What isolates a request's cache besides its tokens: LoRA id and cache salt."""
    if request.lora_request is None and request.cache_salt is None:
        return None
    return (request.lora_int_id, request.cache_salt)


def update_block_hashes(request: "Request", block_size: int, hash_fn: HashFunction) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens.

    Hashes are computed once per block: token ids of a full block never change (draft
    tokens are not in ``all_token_ids`` until accepted), so the list only grows.
    """
    hashes = request.block_hashes
    num_full_blocks = len(request.all_token_ids) // block_size
    tokens = request.all_token_ids
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i > 0 else None
        extra = first_block_extra_keys(request) if i == 0 else None
        hashes.append(hash_block_tokens(hash_fn, parent, tokens[i * block_size : (i + 1) * block_size], extra))
    return hashes
