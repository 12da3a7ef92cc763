"""'Did you mean': the known name an operator most likely meant by a name the kit does not read.

Names are compared word by word (split on '_'), each word weighted by how rare it is among the
known names: `epd_engines_start_timeout_s` shares its rare words start/timeout with
`epd_start_timeout_s`, and only the common `engines` with `epd_engines_stop_timeout_s`, so the
first is the hint although the second differs by fewer letters. Misspelt words count in part.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection

MIN_SCORE = 0.5


def _words(name: str) -> list[str]:
    return [word for word in name.lower().split("_") if word and word != "epd"]


def _word_match(word: str, words: list[str]) -> tuple[float, str | None]:
    if word in words:
        return 1.0, word
    best, best_word = 0.0, None
    for other in words:
        ratio = difflib.SequenceMatcher(None, word, other).ratio()
        if len(word) >= 3 and ratio >= 0.75 and ratio > best:
            best, best_word = ratio, other
    return best, best_word


def nearest(name: str, known: Collection[str]) -> str | None:
    """The known name most likely meant, or None when nothing is close."""
    documents = [set(_words(k)) for k in known]
    count = len(documents) or 1

    def weight(word: str) -> float:
        return math.log(1 + count / (1 + sum(word in d for d in documents)))

    words = _words(name)
    best: tuple[float, float, str] | None = None
    for candidate in known:
        theirs = _words(candidate)
        shared = total = 0.0
        matched: set[str] = set()
        for word in words:
            score, other = _word_match(word, theirs)
            if other is not None:
                matched.add(other)
            shared += score * weight(other or word)
            total += weight(other or word)
        total += sum(weight(w) for w in theirs if w not in matched)
        score = shared / total if total else 0.0
        letters = difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio()
        if score >= MIN_SCORE or letters >= 0.85:
            key = (score + letters / 2, letters, candidate)
            if best is None or key[:2] > best[:2]:
                best = key
    return best[2] if best else None


def did_you_mean(name: str, known: Collection[str], fallback: str) -> str:
    near = nearest(name, known)
    return f"did you mean {near}?" if near else fallback
