"""Metric samples: one scrape of one or more sources, summed over the sources.

A source is a router's /metrics (every router host of the fleet; a host's router processes
already sum theirs, router/metrics.py), an engine's /metrics, a saved scrape file, or a
Prometheus server's instant query at a given time. Series with the same name and labels are
summed over sources: counters and in-flight gauges add up across routers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# Labels a Prometheus server adds per target (docs/observability.md "Scrape targets from the
# plan"): summing over routers drops them, so two routers' series of one engine add up.
# `role` stays: the router job honours the router's own per-engine `role` label.
TARGET_LABELS = frozenset({"instance", "job", "host", "engine_id"})
# The series the advisor reads (router: epd_router_*, engines: vLLM's vllm:* names).
PROMETHEUS_SELECTOR = '{__name__=~"epd_router_.+|vllm:.+"}'

Labels = tuple[tuple[str, str], ...]


class ScrapeError(ValueError):
    """A source could not be read or parsed: the message names it and the fix."""


def _key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in TARGET_LABELS))


@dataclass
class Scrape:
    """Samples by (sample name, labels), taken at `at` (unix seconds, when known)."""

    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    at: float | None = None

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if math.isnan(value):
            return
        key = (name, _key(labels))
        self.samples[key] = self.samples.get(key, 0.0) + value

    def merge(self, other: Scrape) -> None:
        for (name, labels), value in other.samples.items():
            self.add(name, dict(labels), value)
        if self.at is None:
            self.at = other.at

    def total(self, name: str, **match: str) -> float:
        """The sum of every series of `name` whose labels include `match`."""
        return sum(v for (n, labels), v in self.samples.items() if n == name and set(match.items()) <= set(labels))

    def series(self, name: str) -> dict[Labels, float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def has(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n, _ in self.samples)


def parse_text(text: str, source: str) -> Scrape:
    """A Prometheus text exposition (what /metrics returns, what a saved scrape file holds)."""
    scrape = Scrape()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                scrape.add(sample.name, sample.labels, float(sample.value))
    except ValueError as exc:
        raise ScrapeError(f"{source}: not a Prometheus text exposition ({exc})") from None
    return scrape


def read_files(paths: Iterable[Path]) -> Scrape:
    """Saved scrape files (one per router or engine), summed."""
    scrape = Scrape()
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ScrapeError(f"cannot read the scrape file {path}: {exc.strerror}") from None
        scrape.merge(parse_text(text, str(path)))
    return scrape


def fetch_urls(urls: Iterable[str], timeout_s: float = 10.0) -> tuple[Scrape, dict[str, str]]:
    """One GET /metrics per base URL, summed; also each source's text (for --save)."""
    import httpx  # only the live and Prometheus sources need it

    scrape, texts = Scrape(at=time.time()), {}
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for base in urls:
            url = base.rstrip("/") + "/metrics"
            try:
                resp = client.get(url)
            except httpx.HTTPError as exc:
                raise ScrapeError(f"cannot scrape {url}: {exc}") from None
            if resp.status_code != 200:
                raise ScrapeError(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
            texts[base] = resp.text
            scrape.merge(parse_text(resp.text, url))
    return scrape, texts


def prometheus_at(server: str, at: float, timeout_s: float = 30.0) -> Scrape:
    """Every epd_router_* and vllm:* series of a Prometheus server at time `at` (an instant
    query, /api/v1/query), summed over targets."""
    import httpx

    url = server.rstrip("/") + "/api/v1/query"
    try:
        resp = httpx.get(
            url, params={"query": PROMETHEUS_SELECTOR, "time": f"{at:.3f}"}, timeout=timeout_s, trust_env=False
        )
        doc = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ScrapeError(f"cannot query {url}: {exc}") from None
    if resp.status_code != 200 or doc.get("status") != "success":
        raise ScrapeError(f"{url}: HTTP {resp.status_code}: {doc.get('error', resp.text[:200])}")
    if doc["data"].get("resultType") != "vector":
        raise ScrapeError(f"{url}: expected an instant vector, got {doc['data'].get('resultType')}")
    scrape = Scrape(at=at)
    for item in doc["data"]["result"]:
        labels = dict(item["metric"])
        name = labels.pop("__name__")
        scrape.add(name, labels, float(item["value"][1]))
    return scrape
