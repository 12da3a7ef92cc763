"""Automatic prefix caching as it misbehaves in EPD (tutorial: "Wrong or empty output on
repeated images").

Blocks are keyed by token ids only. A prompt whose leading blocks were seen before reuses the
cached KV. An image placeholder entirely inside the cached prefix is treated as computed: its
embedding is never pulled from the VE and the KV built from the OLD request's embedding is
used. A placeholder that straddles the end of the hit is pulled, but its first part still
comes from the old KV (`blend`). Same image again: same answer; another image with the same
prompt tokens: a wrong answer, and no error. With `--no-enable-prefix-caching` none of this
exists.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

from blake3 import blake3

from ..wire import Placeholder

BLOCK_TOKENS = 16


def _block_hashes(prompt_ids: Sequence[int]) -> list[bytes]:
    # each block's ids as little-endian int64s (struct, not numpy: the sim starts without numpy, epd_kit/asgi.py)
    block = struct.Struct(f"<{BLOCK_TOKENS}q")
    out, prev = [], b""
    for k in range(len(prompt_ids) // BLOCK_TOKENS):
        prev = blake3(prev + block.pack(*prompt_ids[k * BLOCK_TOKENS : (k + 1) * BLOCK_TOKENS])).digest()
        out.append(prev)
    return out


class PrefixCache:
    def __init__(self, capacity_blocks: int = 65536) -> None:
        self.capacity = capacity_blocks
        # block-chain hash -> embeddings (prompt order) of the items that end inside the prefix
        self._store: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()

    def match(self, prompt_ids: Sequence[int]) -> tuple[int, tuple[bytes, ...]]:
        """(cached prefix length in tokens, embeddings of the items that START inside it)."""
        # vLLM always recomputes the last prompt token, so a full-prompt hit is one block short.
        hashes = _block_hashes(prompt_ids[: max(0, len(prompt_ids) - 1)])
        hit, cached = 0, ()
        for k, h in enumerate(hashes, start=1):
            entry = self._store.get(h)
            if entry is None:
                break
            self._store.move_to_end(h)
            hit, cached = k * BLOCK_TOKENS, entry
        return hit, cached

    def insert(
        self,
        prompt_ids: Sequence[int],
        placeholders: Sequence[Placeholder],
        embeddings: Sequence[bytes],
    ) -> None:
        for k, h in enumerate(_block_hashes(prompt_ids), start=1):
            if h in self._store:  # a cached block is reused as is, never rewritten
                self._store.move_to_end(h)
                continue
            end = k * BLOCK_TOKENS
            self._store[h] = tuple(e for ph, e in zip(placeholders, embeddings, strict=True) if ph.offset < end)
        while len(self._store) > self.capacity:
            self._store.popitem(last=False)


def blend(cached: bytes, fresh: bytes) -> bytes:
    """An item whose leading rows come from cached KV and the rest from a fresh read."""
    return cached if cached == fresh else blake3(cached + fresh).digest(length=len(fresh))
