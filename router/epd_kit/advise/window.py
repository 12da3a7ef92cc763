"""What changed between two scrapes: counter increments, histogram increments, engines seen."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .scrape import Scrape, ScrapeError

R = "epd_router_"


@dataclass(frozen=True)
class HistogramDelta:
    """One histogram's observations inside the window."""

    count: float
    total: float  # sum of the observed values
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear inside the bucket; the +Inf bucket answers
        with the largest finite bound."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                if cumulative == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (cumulative - lower_count)
            lower_bound, lower_count = bound, cumulative
        return lower_bound


@dataclass(frozen=True)
class EngineSeen:
    engine: str
    role: str
    active: bool  # healthy and not draining at the second scrape
    inflight_before: float
    inflight_after: float


class Window:
    """Two scrapes `seconds` apart."""

    def __init__(self, before: Scrape, after: Scrape, seconds: float) -> None:
        if not seconds > 0:
            raise ScrapeError(f"the window must be longer than 0 s, got {seconds}")
        if not after.has(R):
            raise ScrapeError(
                "no epd_router_* series in the second scrape: point --url at the router (port 18800), "
                "--prometheus at a server that scrapes it, or give the router's saved /metrics"
            )
        self.before, self.after, self.seconds = before, after, seconds

    def counter(self, name: str, **match: str) -> float:
        """The increment of a counter (summed over its series matching `match`)."""
        after, before = self.after.total(name, **match), self.before.total(name, **match)
        if after < before:
            raise ScrapeError(
                f"{name} went down between the scrapes ({before:g} -> {after:g}): a router restarted inside "
                "the window; take the window again"
            )
        return after - before

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        """A counter's increments per value of one label (over its series matching `match`)."""
        values = {
            dict(labels).get(label, "") for labels in self.after.series(name) if set(match.items()) <= set(labels)
        }
        return {value: self.counter(name, **match, **{label: value}) for value in sorted(values)}

    def label_values(self, name: str, label: str) -> set[str]:
        """The values one label takes on a series at the second scrape."""
        return {dict(labels)[label] for labels in self.after.series(name) if label in dict(labels)}

    def histogram(self, name: str, **match: str) -> HistogramDelta:
        """A histogram's increments (summed over its series matching `match`); buckets matched
        by their bound's value, not its spelling."""
        before, after = _buckets(self.before, name, match), _buckets(self.after, name, match)
        for bound, cumulative in after.items():
            if cumulative < before.get(bound, 0.0):
                raise ScrapeError(f"{name} went down between the scrapes: a router restarted inside the window")
        buckets = tuple((b, after[b] - before.get(b, 0.0)) for b in sorted(after))
        return HistogramDelta(self.counter(f"{name}_count", **match), self.counter(f"{name}_sum", **match), buckets)

    def engines(self, model: str | None = None) -> list[EngineSeen]:
        """The engines the routers saw at the second scrape (`model`: that model's only)."""
        healthy = self.after.series(f"{R}engine_healthy")
        draining = {dict(k).get("engine"): v for k, v in self.after.series(f"{R}engine_draining").items()}
        seen = []
        for labels, value in sorted(healthy.items()):
            tags = dict(labels)
            if model is not None and tags.get("model") != model:
                continue
            engine, role = tags.get("engine", ""), tags.get("role", "")
            seen.append(
                EngineSeen(
                    engine,
                    role,
                    value > 0 and not draining.get(engine, 0) > 0,
                    self.before.total(f"{R}engine_inflight", engine=engine),
                    self.after.total(f"{R}engine_inflight", engine=engine),
                )
            )
        return seen


def _buckets(scrape: Scrape, name: str, match: dict[str, str]) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, value in scrape.series(f"{name}_bucket").items():
        if not set(match.items()) <= set(labels):
            continue
        le = dict(labels).get("le")
        if le is not None:
            bound = float(le)
            out[bound] = out.get(bound, 0.0) + value
    return out
