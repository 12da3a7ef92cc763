"""The APC hazard model: cached prefixes reuse old embeddings, keyed by token ids only."""

from __future__ import annotations

from epd_kit.sim.prefix_cache import BLOCK_TOKENS, PrefixCache, blend
from epd_kit.wire import Placeholder


def test_token_keyed_hit_returns_the_old_embeddings() -> None:
    cache = PrefixCache()
    prompt = list(range(100))
    phs = [Placeholder(offset=4, length=16), Placeholder(offset=40, length=40)]
    cache.insert(prompt, phs, [b"A", b"B"])
    hit, cached = cache.match(prompt)
    assert hit == (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert cached == (b"A", b"B")
    assert cache.match([999] + prompt[1:]) == (0, ())


def test_cached_blocks_are_not_rewritten() -> None:
    cache = PrefixCache()
    prompt = list(range(40))
    phs = [Placeholder(offset=2, length=8)]
    cache.insert(prompt, phs, [b"A"])
    cache.insert(prompt, phs, [b"B"])
    assert cache.match(prompt)[1] == (b"A",)


def test_capacity_bounds_the_store() -> None:
    cache = PrefixCache(capacity_blocks=4)
    for i in range(10):
        cache.insert([i] * 32, [], [])
    assert len(cache._store) == 4


def test_blend() -> None:
    assert blend(b"x" * 8, b"x" * 8) == b"x" * 8
    assert blend(b"x" * 8, b"y" * 8) not in (b"x" * 8, b"y" * 8)
