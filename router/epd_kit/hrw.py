"""Rendezvous (highest-random-weight) hashing, exactly the reference's scoring (docs/contract.md §4.1).

score(key, candidate) = BLAKE2b(digest_size=8) over UTF8(key) || 0x00 || UTF8(candidate);
the highest digest (compared as raw bytes) wins, ties go to the larger candidate id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(key: str, candidate: str) -> bytes:
    return hashlib.blake2b(key.encode() + b"\x00" + candidate.encode(), digest_size=8).digest()


def rank(key: str, candidates: Iterable[str]) -> list[str]:
    """Candidates from best to worst for `key`; independent of input order."""
    ranked = sorted(candidates, key=lambda c: (score(key, c), c), reverse=True)
    if not ranked:
        raise ValueError("rendezvous hashing needs at least one candidate")
    return ranked


def pick(key: str, candidates: Iterable[str]) -> str:
    return rank(key, candidates)[0]
