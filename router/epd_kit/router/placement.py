"""Pure placement policy: which VE encodes an item, which PD generates. No I/O, no clocks.

The service and the benchmark's discrete-event simulation drive the same functions.

VE: rendezvous hashing on the content hash (docs/contract.md §4.1 scoring, `epd_kit.hrw`) over the
eligible VE ids, with a bounded-load rule: a VE is skipped when its in-flight work plus the
new item would exceed `bound × mean + slack_items × the item's work` (mean over eligible VEs,
counting the new item), and the item takes its next HRW choice. So a hot image stays on one VE
(cache affinity) until that VE is clearly busier than the pool, then spills deterministically
to its second choice. The slack matters at low concurrency, where the mean is a fraction of
one image and a pure ratio would spill on any queue and lose the cache hit (docs/benchmarks.md
§3 measured it: a bound alone keeps 64 % of the ceiling hit rate at Zipf 0.8, with 6 items of
slack 95 %).

PD: least outstanding requests below a per-PD cap, ties broken round-robin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from epd_kit import hrw


@dataclass(frozen=True)
class Item:
    """One unique media item to place: its content hash and its encode work (tokens)."""

    mm_hash: str
    work: int = 1


def dedupe(items: Iterable[Item]) -> list[Item]:
    """Unique items by hash, first occurrence wins (docs/contract.md §2.1)."""
    seen: dict[str, Item] = {}
    for item in items:
        seen.setdefault(item.mm_hash, item)
    return list(seen.values())


def choose_ve(
    item: Item,
    loads: Mapping[str, float],
    bound: float | None,
    exclude: Iterable[str] = (),
    slack_items: float = 0.0,
) -> str | None:
    """The VE for one item given current in-flight work per eligible VE id.

    `loads` holds only eligible VEs (healthy, not draining). `exclude` are VEs that already
    failed this item. Returns None when no candidate is left.
    """
    excluded = set(exclude)
    candidates = [c for c in loads if c not in excluded]
    if not candidates:
        return None
    ranked = hrw.rank(item.mm_hash, candidates)
    if bound is None or len(ranked) == 1:
        return ranked[0]
    total = sum(loads[c] for c in candidates) + item.work
    capacity = bound * total / len(candidates) + slack_items * item.work
    for cand in ranked:
        if loads[cand] + item.work <= capacity:
            return cand
    # everyone is above the bound (can happen for one item much bigger than the mean):
    # the least loaded VE, HRW order breaking ties
    return min(ranked, key=lambda c: loads[c])


def place_items(
    items: Sequence[Item],
    loads: Mapping[str, float],
    bound: float | None,
    exclude: Mapping[str, Iterable[str]] | None = None,
    slack_items: float = 0.0,
) -> dict[str, str]:
    """mm_hash → VE id for unique items, accounting for this request's own placements.

    Raises LookupError when an item has no candidate left.
    """
    running = dict(loads)
    exclude = exclude or {}
    out: dict[str, str] = {}
    for item in dedupe(items):
        ve = choose_ve(item, running, bound, exclude.get(item.mm_hash, ()), slack_items)
        if ve is None:
            raise LookupError(item.mm_hash)
        out[item.mm_hash] = ve
        running[ve] += item.work
    return out


def group_by_ve(placement: Mapping[str, str]) -> dict[str, list[str]]:
    """VE id → hashes in placement order (one POST per VE per request)."""
    groups: dict[str, list[str]] = {}
    for mm_hash, ve in placement.items():
        groups.setdefault(ve, []).append(mm_hash)
    return groups


@dataclass
class RoundRobin:
    """Tie-break cursor for PD selection; the only state the PD policy keeps."""

    cursor: int = 0

    def choose_pd(
        self,
        candidates: Sequence[str],
        inflight: Mapping[str, int],
        cap: int,
        exclude: Iterable[str] = (),
    ) -> str | None:
        """Least outstanding requests among PDs below `cap`; ties go round-robin.

        `candidates` must be in a stable order (config order). None = all saturated/excluded.
        """
        excluded = set(exclude)
        open_ = [c for c in candidates if c not in excluded and inflight.get(c, 0) < cap]
        if not open_:
            return None
        least = min(inflight.get(c, 0) for c in open_)
        tied = [c for c in open_ if inflight.get(c, 0) == least]
        n = len(candidates)
        # first tied candidate at or after the cursor position (in config order)
        order = {c: (candidates.index(c) - self.cursor) % n for c in tied}
        pick = min(tied, key=order.__getitem__)
        self.cursor = (candidates.index(pick) + 1) % n
        return pick
