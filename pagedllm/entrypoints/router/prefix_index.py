"""What one replica has probably cached: the chained hashes of the character chunks of prompts sent
there, LRU-evicted under a size bound (an approximate radix tree, as SGLang's router keeps).

    text:    |-- chunk 0 --|-- chunk 1 --|-- chunk 2 --|-tail-|
    hashes:      h0 = H(c0)   h1 = H(h0,c1)  h2 = H(h1,c2)       (the tail is never indexed)

A chained hash names a whole prefix, so a match is the run of leading hashes present in the index,
like the engine's block hashes. Characters stand in for tokens: the router never tokenizes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """The chained hash of every whole `chunk_chars` chunk of `text`, first chunk first."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[start : start + chunk_chars].encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """A bounded set of chunk hashes with LRU order.

    Invariant: a prefix's hashes are touched deepest first, so a parent is always more recent than
    its children and eviction (oldest first) removes leaves before the prefixes they extend."""

    def __init__(self, chunk_chars: int = 64, max_chunks: int = 65536) -> None:
        if chunk_chars < 1 or max_chunks < 1:
            raise ValueError(f"chunk_chars ({chunk_chars}) and max_chunks ({max_chunks}) must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match_chars(self, hashes: list[bytes]) -> int:
        """How many leading characters of the prompt behind `hashes` this replica has seen."""
        num_matched = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            num_matched += 1
        return num_matched * self.chunk_chars

    def insert(self, hashes: list[bytes]) -> None:
        """Record a prompt sent to this replica, then evict the least recently used chunks."""
        for block_hash in reversed(hashes):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_chunks:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the replica went down; whatever it had cached may be gone)."""
        self._hashes.clear()
