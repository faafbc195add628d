"""Chained content hashes of full KV blocks: the keys of the prefix cache.

    block 0: hash(b"",     tokens[0:16],  salt, adapter)   salt and adapter only in the first block
    block 1: hash(hash_0,  tokens[16:32])
    block 2: hash(hash_1,  tokens[32:48])         a block's hash names its whole prefix

Two requests share block i only if every token before the end of block i is equal (and
so is the cache salt, and the LoRA adapter they run under: K/V computed under one adapter is
never served to another, nor to the base model). The hash is collision resistant (sha256, or
xxh3-128 when asked for speed) over a fixed byte encoding, never Python's salted `hash()`. A partial last
block has no hash and is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from pagedllm.request import Request

BlockHash = bytes
HashFunction = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_function(algo: str) -> HashFunction:
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        import xxhash

        return xxhash.xxh3_128_digest
    raise ValueError(f"prefix_caching_hash_algo: unknown {algo!r}; use sha256 or xxhash")


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora_key: str | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    parts = [parent_hash or b"", array("q", token_ids).tobytes()]
    for tag, key in ((b"salt", cache_salt), (b"lora", lora_key)):
        if key is not None:
            data = key.encode()
            parts.append(tag + len(data).to_bytes(4, "little") + data)
    return hash_fn(b"".join(parts))


def extend_block_hashes(request: Request, block_size: int, hash_fn: HashFunction) -> None:
    """Hash every block of `request` that is full and not hashed yet."""
    lora_key = request.lora_request.cache_key if request.lora_request is not None else None
    extend_hashes(
        request.block_hashes, request.all_token_ids, block_size, hash_fn, request.cache_salt, lora_key
    )


def extend_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFunction,
    cache_salt: str | None = None,
    lora_key: str | None = None,
) -> list[BlockHash]:
    """Append to `hashes` the chained hashes of the full blocks of `token_ids` it lacks (the salt
    and the adapter go into the first block's); returns `hashes`."""
    while len(hashes) < len(token_ids) // block_size:
        index = len(hashes)
        start = index * block_size
        parent = hashes[-1] if hashes else None
        first = index == 0
        block = token_ids[start : start + block_size]
        hashes.append(
            hash_block_tokens(
                hash_fn, parent, block, cache_salt if first else None, lora_key if first else None
            )
        )
    return hashes
