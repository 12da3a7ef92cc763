"""The simulated model: pure, deterministic functions shared by the sim and by tests.

- A VE "encodes" an item into embedding bytes that depend only on its mm_hash.
- A PD's output token ids depend on the prompt ids AND the embedding bytes it actually read
  (in prompt order, duplicates kept), so a test can prove that the right image reached the
  right request: compare the answer with `expected_tokens(...)`.

Finish rule (docs/sim.md): the model "wants" `natural_length` tokens (16..256, derived from
the same seed) and then an end-of-sequence token, which is consumed and never emitted.
If `natural_length < max_tokens` (and ignore_eos is off) the answer has `natural_length`
tokens and finish_reason "stop"; otherwise it has `max_tokens` tokens and "length".
A token from `stop_token_ids` also stops (it is included, finish_reason "stop").
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blake3 import blake3

from .checkpoint import VocabSpace

EMBEDDING_BYTES = 64  # compact stand-in for a block's rows; enough to tell any two items apart
NATURAL_MIN, NATURAL_MAX = 16, 256


def embedding_bytes(mm_hash: str) -> bytes:
    """What a VE writes into an encoder-cache block for this item."""
    return blake3(b"epd-sim/embedding\x00" + mm_hash.encode()).digest(length=EMBEDDING_BYTES)


def generation_seed(prompt_ids: Sequence[int], embeddings: Iterable[bytes]) -> bytes:
    h = blake3(b"epd-sim/generate\x00")
    # the ids as little-endian int64s (struct, not numpy: the sim starts without numpy, epd_kit/asgi.py)
    h.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    for emb in embeddings:
        h.update(b"\x00")
        h.update(emb)
    return h.digest()


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"


def natural_length(seed: bytes) -> int:
    u = int.from_bytes(blake3(b"len\x00" + seed).digest(length=4), "little")
    return NATURAL_MIN + u % (NATURAL_MAX - NATURAL_MIN + 1)


def plan_generation(
    prompt_ids: Sequence[int],
    embeddings: Sequence[bytes],
    max_tokens: int,
    vocab: VocabSpace,
    *,
    ignore_eos: bool = False,
    stop_token_ids: Iterable[int] = (),
) -> Generation:
    """The whole answer a PD gives, from what it actually holds."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    seed = generation_seed(prompt_ids, embeddings)
    natural = natural_length(seed)
    if not ignore_eos and natural < max_tokens:
        n, finish = natural, "stop"
    else:
        n, finish = max_tokens, "length"
    stream = struct.unpack(f"<{n}I", blake3(b"tok\x00" + seed).digest(length=4 * n))
    allowed = vocab.allowed_ids
    tokens = [allowed[u % len(allowed)] for u in stream]
    stops = set(stop_token_ids)
    if stops:
        for i, tok in enumerate(tokens):
            if tok in stops:
                return Generation(tuple(tokens[: i + 1]), "stop")
    return Generation(tuple(tokens), finish)


def expected_tokens(
    prompt_ids: Sequence[int],
    mm_hashes_in_order: Sequence[str],
    max_tokens: int,
    vocab: VocabSpace,
    *,
    ignore_eos: bool = False,
    stop_token_ids: Iterable[int] = (),
) -> Generation:
    """What a correct EPD deployment answers: every item's embedding read intact from its VE."""
    return plan_generation(
        prompt_ids,
        [embedding_bytes(h) for h in mm_hashes_in_order],
        max_tokens,
        vocab,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
