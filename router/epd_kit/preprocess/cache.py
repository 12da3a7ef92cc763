"""A bounded LRU of prepared images, by mm_hash, bounded in entries and in bytes.

Entries hold the serialized kwargs strings (a 512x512 image is ~5.6 MB of base64), so the
byte bound is what really limits memory. Only touched from the event loop: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class LruCache(Generic[V]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0 (0 disables the cache)")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.stats = CacheStats()

    def get(self, key: str) -> V | None:
        entry = self._data.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._data.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def put(self, key: str, value: V, size: int) -> None:
        if self.max_entries == 0 or size > self.max_bytes:
            return
        if key in self._data:
            self.stats.bytes -= self._data.pop(key)[1]
        self._data[key] = (value, size)
        self.stats.bytes += size
        while len(self._data) > self.max_entries or self.stats.bytes > self.max_bytes:
            _, (_, evicted) = self._data.popitem(last=False)
            self.stats.bytes -= evicted
            self.stats.evictions += 1
        self.stats.entries = len(self._data)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
