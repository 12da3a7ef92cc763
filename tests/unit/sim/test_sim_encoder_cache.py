"""VE encoder cache: one image per block, scratch block reserved, LRU + minimum hold."""

from __future__ import annotations

import pytest

from epd_kit.sim.encoder_cache import EncoderCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scratch_block_is_never_handed_out() -> None:
    cache = EncoderCache(3, 0.1, Clock())
    got = {cache.allocate(h, set()) for h in ("a", "b")}
    assert got == {0, 1} and cache.capacity == 2
    assert cache.read(2) is None  # scratch is not readable through a locator


def test_lru_eviction_respects_hold_time() -> None:
    clock = Clock()
    cache = EncoderCache(3, 0.1, clock)
    for h in ("a", "b"):
        cache.write(cache.allocate(h, set()), h.encode())
    assert cache.allocate("c", set()) is None  # both within their 100 ms hold
    assert cache.wait_hint_s(set()) == pytest.approx(0.1)
    clock.now = 0.2
    assert cache.lookup("a") == 0  # touch a: b is now least recently used
    assert cache.allocate("c", set()) == 1
    assert cache.lookup("b") is None and cache.read(1) == b""  # unwritten until encoded
    clock.now = 0.5
    assert cache.allocate("d", keep={0}) is None  # c is still being encoded
    cache.write(1, b"C")
    clock.now = 0.55
    assert cache.allocate("d", keep={0}) is None  # c was written 50 ms ago
    clock.now = 0.61
    assert cache.allocate("d", keep={0}) == 1 and cache.lookup("c") is None


def test_blocks_of_the_current_request_are_kept() -> None:
    clock = Clock()
    cache = EncoderCache(2, 0.0, clock)
    cache.write(cache.allocate("a", set()), b"A")
    assert cache.allocate("b", keep={0}) is None
    assert cache.allocate("b", keep=set()) == 0


def test_release_unwritten() -> None:
    cache = EncoderCache(2, 0.0, Clock())
    block = cache.allocate("a", set())
    cache.release_unwritten(block)
    assert cache.lookup("a") is None and cache.allocate("b", set()) == block
