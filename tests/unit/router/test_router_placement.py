"""VE and PD placement policy (router/epd_kit/router/placement.py): pure functions."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit import hrw
from epd_kit.router.placement import Item, RoundRobin, choose_ve, dedupe, group_by_ve, place_items


def test_contract_vectors_through_placement():
    # docs/contract.md §4.1: with no load, placement is exactly the reference HRW choice
    idle3 = {"ve-0": 0, "ve-1": 0, "ve-2": 0}
    assert choose_ve(Item("img-hash-1"), idle3, bound=1.25) == "ve-1"
    assert choose_ve(Item("a3f1"), idle3, bound=1.25) == "ve-2"
    assert choose_ve(Item("a3f1"), {"ve-0": 0, "ve-1": 0}, bound=1.25) == "ve-0"


@given(key=st.text(min_size=1, max_size=12), n=st.integers(1, 6))
def test_idle_pool_matches_hrw(key, n):
    loads = {f"ve-{i}": 0 for i in range(n)}
    assert choose_ve(Item(key), loads, bound=1.25) == hrw.pick(key, loads)


def test_load_bound_spills_to_second_choice():
    key = "img-hash-1"  # HRW order: ve-1, ve-2, ve-0 (contract scores)
    assert hrw.rank(key, ["ve-0", "ve-1", "ve-2"]) == ["ve-1", "ve-2", "ve-0"]
    # ve-1 busy: 10 in flight vs 0 → mean with new item = 11/3, bound 1.25 → cap 4.58
    assert choose_ve(Item(key), {"ve-0": 0, "ve-1": 10, "ve-2": 0}, bound=1.25) == "ve-2"
    # the same load without a bound keeps affinity
    assert choose_ve(Item(key), {"ve-0": 0, "ve-1": 10, "ve-2": 0}, bound=None) == "ve-1"
    # a small imbalance stays within the bound: affinity kept
    assert choose_ve(Item(key), {"ve-0": 3, "ve-1": 3, "ve-2": 3}, bound=1.25) == "ve-1"
    assert choose_ve(Item(key), {"ve-0": 2, "ve-1": 3, "ve-2": 2}, bound=1.25) == "ve-2"  # 4 > 1.25*8/3


def test_slack_keeps_affinity_for_a_short_queue_and_still_spills_a_long_one():
    key = "img-hash-1"  # HRW first choice ve-1
    # one image (work 4) queued on ve-1, the others idle: the pure ratio spills (cap 1.15*8/3 ≈ 3.1)
    assert choose_ve(Item(key, 4), {"ve-0": 0, "ve-1": 4, "ve-2": 0}, bound=1.15) == "ve-2"
    # 6 items of slack (cap ≈ 3.1 + 24) keep the cache affinity
    assert choose_ve(Item(key, 4), {"ve-0": 0, "ve-1": 4, "ve-2": 0}, bound=1.15, slack_items=6) == "ve-1"
    # far beyond the slack it still spills: 40 queued > 1.15*44/3 + 24 ≈ 40.9 - 4
    assert choose_ve(Item(key, 4), {"ve-0": 0, "ve-1": 40, "ve-2": 0}, bound=1.15, slack_items=6) == "ve-2"


def test_load_bound_both_first_choices_busy_takes_third():
    key = "img-hash-1"
    assert choose_ve(Item(key), {"ve-0": 0, "ve-1": 10, "ve-2": 10}, bound=1.25) == "ve-0"


def test_hot_image_does_not_swamp_one_ve():
    """Many concurrent requests for one image: with the bound, work spreads; without, one VE."""

    def run(bound):
        loads = {f"ve-{i}": 0 for i in range(4)}
        for _ in range(40):  # 40 in-flight encodes of the same hot image, none finished
            loads[choose_ve(Item("hot", work=1), loads, bound)] += 1
        return loads

    unbounded = run(None)
    assert max(unbounded.values()) == 40
    bounded = run(1.25)
    mean = sum(bounded.values()) / 4
    assert max(bounded.values()) <= 1.25 * mean + 1
    assert sum(bounded.values()) == 40


@settings(max_examples=60)
@given(
    loads=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    key=st.text(min_size=1, max_size=8),
    work=st.integers(1, 20),
    bound=st.floats(1.0, 3.0),
)
def test_bound_respected_whenever_possible(loads, key, work, bound):
    pool = {f"ve-{i}": load for i, load in enumerate(loads)}
    ve = choose_ve(Item(key, work), pool, bound)
    cap = bound * (sum(loads) + work) / len(loads)
    if any(load + work <= cap for load in loads):
        assert pool[ve] + work <= cap
        # and it is the first HRW choice that fits
        for cand in hrw.rank(key, pool):
            if pool[cand] + work <= cap:
                assert cand == ve
                break
    else:
        assert pool[ve] == min(loads)


def test_exclude_takes_next_hrw_choice_and_none_when_exhausted():
    idle = {"ve-0": 0, "ve-1": 0, "ve-2": 0}
    assert choose_ve(Item("img-hash-1"), idle, 1.25, exclude={"ve-1"}) == "ve-2"
    assert choose_ve(Item("img-hash-1"), idle, 1.25, exclude={"ve-1", "ve-2"}) == "ve-0"
    assert choose_ve(Item("img-hash-1"), idle, 1.25, exclude=set(idle)) is None
    assert choose_ve(Item("x"), {}, 1.25) is None


def test_place_items_dedupes_and_groups_one_post_per_ve():
    items = [Item("a", 4), Item("b", 4), Item("a", 4), Item("c", 4)]
    assert [i.mm_hash for i in dedupe(items)] == ["a", "b", "c"]
    placement = place_items(items, {"ve-0": 0, "ve-1": 0}, bound=None)
    assert set(placement) == {"a", "b", "c"}
    groups = group_by_ve(placement)
    assert sorted(h for hs in groups.values() for h in hs) == ["a", "b", "c"]
    assert all(placement[h] == ve for ve, hs in groups.items() for h in hs)


def test_place_items_counts_own_placements_against_the_bound():
    # 30 distinct items of one request on 3 idle VEs: no VE gets more than bound × mean
    items = [Item(f"img-{i}", 10) for i in range(30)]
    placement = place_items(items, {"ve-0": 0, "ve-1": 0, "ve-2": 0}, bound=1.25)
    per_ve = Counter(placement.values())
    assert max(per_ve.values()) * 10 <= 1.25 * 300 / 3 + 10


def test_place_items_raises_when_an_item_has_no_candidate():
    with pytest.raises(LookupError):
        place_items([Item("a")], {"ve-0": 0}, 1.25, exclude={"a": {"ve-0"}})


def test_pd_least_outstanding_with_round_robin_ties():
    rr = RoundRobin()
    ids = ["pd-0", "pd-1", "pd-2"]
    idle = dict.fromkeys(ids, 0)
    assert [rr.choose_pd(ids, idle, cap=4) for _ in range(4)] == ["pd-0", "pd-1", "pd-2", "pd-0"]
    assert rr.choose_pd(ids, {"pd-0": 3, "pd-1": 1, "pd-2": 2}, cap=4) == "pd-1"


def test_pd_cap_and_exclusion():
    rr = RoundRobin()
    ids = ["pd-0", "pd-1"]
    assert rr.choose_pd(ids, {"pd-0": 2, "pd-1": 2}, cap=2) is None
    assert rr.choose_pd(ids, {"pd-0": 0, "pd-1": 1}, cap=2, exclude={"pd-0"}) == "pd-1"
    assert rr.choose_pd(ids, {"pd-0": 0, "pd-1": 0}, cap=2, exclude=set(ids)) is None


def test_pd_round_robin_spreads_sequential_requests_evenly():
    rr = RoundRobin()
    ids = [f"pd-{i}" for i in range(3)]
    picks = Counter(rr.choose_pd(ids, dict.fromkeys(ids, 0), cap=8) for _ in range(30))
    assert set(picks.values()) == {10}
