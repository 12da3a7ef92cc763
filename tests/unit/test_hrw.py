"""Rendezvous hashing: the contract's test vectors (§4.1) and its stability properties."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_kit import hrw


def test_contract_vectors_scores():
    assert hrw.score("img-hash-1", "ve-0").hex() == "4e8de613f0145e96"
    assert hrw.score("img-hash-1", "ve-1").hex() == "6ade037d80ad36ee"
    assert hrw.score("img-hash-1", "ve-2").hex() == "58f318af407538c9"


def test_contract_vectors_winners():
    assert hrw.pick("img-hash-1", ["ve-0", "ve-1", "ve-2"]) == "ve-1"
    assert hrw.pick("a3f1", ["ve-0", "ve-1", "ve-2"]) == "ve-2"
    assert hrw.pick("a3f1", ["ve-0", "ve-1"]) == "ve-0"


def test_empty_candidates_rejected():
    with pytest.raises(ValueError, match="at least one candidate"):
        hrw.pick("k", [])


ids = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=8, unique=True)


@given(key=st.text(max_size=20), candidates=ids)
def test_order_independent(key, candidates):
    assert hrw.rank(key, candidates) == hrw.rank(key, list(reversed(candidates)))


@given(key=st.text(max_size=20), candidates=ids)
def test_removing_a_loser_keeps_the_winner(key, candidates):
    winner = hrw.pick(key, candidates)
    rest = [c for c in candidates if c != winner]
    for loser in rest:
        assert hrw.pick(key, [c for c in candidates if c != loser]) == winner
