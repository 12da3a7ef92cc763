"""The simulated model: deterministic, image-sensitive, within the checkpoint's plain vocab."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit.sim.checkpoint import load_checkpoint
from epd_kit.sim.model import (
    NATURAL_MAX,
    NATURAL_MIN,
    embedding_bytes,
    expected_tokens,
    plan_generation,
)


def test_vocab_of_the_tiny_checkpoint_avoids_specials(tiny_ckpt) -> None:
    info = load_checkpoint(tiny_ckpt)
    tok = json.loads((tiny_ckpt / "tokenizer.json").read_text())
    specials = {t["id"] for t in tok["added_tokens"]}
    assert info.vocab.allowed_ids and not specials & set(info.vocab.allowed_ids)
    assert max(info.vocab.allowed_ids) < info.vocab.vocab_size
    assert info.is_multimodal and info.vision.patch_dim == 1536


def test_output_depends_on_prompt_and_images(tiny_ckpt) -> None:
    vocab = load_checkpoint(tiny_ckpt).vocab
    base = expected_tokens([1, 2, 3], ["a", "b"], 32, vocab, ignore_eos=True)
    assert base == expected_tokens([1, 2, 3], ["a", "b"], 32, vocab, ignore_eos=True)
    assert base != expected_tokens([1, 2, 3], ["b", "a"], 32, vocab, ignore_eos=True)
    assert base != expected_tokens([1, 2, 4], ["a", "b"], 32, vocab, ignore_eos=True)
    assert base == plan_generation([1, 2, 3], [embedding_bytes("a"), embedding_bytes("b")], 32, vocab, ignore_eos=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=20), st.integers(1, 400))
def test_finish_rule(tiny_ckpt, prompt, max_tokens) -> None:
    vocab = load_checkpoint(tiny_ckpt).vocab
    gen = expected_tokens(prompt, [], max_tokens, vocab)
    if gen.finish_reason == "stop":
        assert NATURAL_MIN <= len(gen.token_ids) < max_tokens
    else:
        assert len(gen.token_ids) == max_tokens
        assert max_tokens <= NATURAL_MAX
    assert set(gen.token_ids) <= set(vocab.allowed_ids)
    forced = expected_tokens(prompt, [], max_tokens, vocab, ignore_eos=True)
    assert len(forced.token_ids) == max_tokens and forced.finish_reason == "length"


def test_stop_token_ids_stop_and_are_included(tiny_ckpt) -> None:
    vocab = load_checkpoint(tiny_ckpt).vocab
    full = expected_tokens([9], [], 50, vocab, ignore_eos=True)
    stop_at = full.token_ids[5]
    gen = expected_tokens([9], [], 50, vocab, ignore_eos=True, stop_token_ids=[stop_at])
    cut = full.token_ids.index(stop_at)
    assert gen.token_ids == full.token_ids[: cut + 1] and gen.finish_reason == "stop"
