"""The VE's on-device encoder cache: fixed blocks, one image per block, LRU with a minimum
hold time after each write (docs/contract.md §3.5: no pin-until-consumed; the hold is the only guard
against a PD reading a block that was already reused)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    mm_hash: str | None = None
    data: bytes = b""  # what an RDMA READ of the block returns right now
    written_at: float = float("-inf")


class EncoderCache:
    def __init__(self, num_blocks: int, min_hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 2:
            raise ValueError("the encoder cache needs at least 2 blocks (one is scratch)")
        self.num_blocks = num_blocks
        self.min_hold_s = min_hold_s
        self._clock = clock
        # The last block is the scratch block: never handed out, never in a locator.
        self._blocks = [Block(i) for i in range(num_blocks - 1)]
        self._resident: OrderedDict[str, int] = OrderedDict()  # mm_hash -> block, LRU first
        self._free = list(range(num_blocks - 2, -1, -1))  # pop() gives 0 first

    @property
    def capacity(self) -> int:
        return len(self._blocks)

    def lookup(self, mm_hash: str) -> int | None:
        """Block holding `mm_hash` (a hit refreshes its LRU position)."""
        block_id = self._resident.get(mm_hash)
        if block_id is not None:
            self._resident.move_to_end(mm_hash)
        return block_id

    def allocate(self, mm_hash: str, keep: set[int]) -> int | None:
        """A block for a new item: a free one, else the LRU block past its hold time that is
        not in `keep` (blocks of the current request). None if every candidate is held."""
        if self._free:
            block_id = self._free.pop()
        else:
            now = self._clock()
            for old_hash, candidate in self._resident.items():
                blk = self._blocks[candidate]
                if candidate not in keep and now - blk.written_at >= self.min_hold_s:
                    del self._resident[old_hash]
                    block_id = candidate
                    break
            else:
                return None
        blk = self._blocks[block_id]
        blk.mm_hash, blk.data, blk.written_at = mm_hash, b"", float("inf")
        self._resident[mm_hash] = block_id
        return block_id

    def wait_hint_s(self, keep: set[int]) -> float:
        """How long until some block not in `keep` leaves its hold time."""
        now = self._clock()
        waits = [self._blocks[b].written_at + self.min_hold_s - now for b in self._resident.values() if b not in keep]
        return max(0.0, min(waits, default=self.min_hold_s))

    def write(self, block_id: int, data: bytes) -> None:
        blk = self._blocks[block_id]
        blk.data, blk.written_at = data, self._clock()

    def read(self, block_id: int) -> bytes | None:
        """Current contents of a block (None for an id outside the cache)."""
        if not 0 <= block_id < len(self._blocks):
            return None
        return self._blocks[block_id].data

    def release_unwritten(self, block_id: int) -> None:
        """Undo an allocation whose encode did not happen (request failed)."""
        blk = self._blocks[block_id]
        if blk.mm_hash is not None and self._resident.get(blk.mm_hash) == block_id:
            del self._resident[blk.mm_hash]
        blk.mm_hash, blk.data, blk.written_at = None, b"", float("-inf")
        self._free.append(block_id)
