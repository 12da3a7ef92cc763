"""Prometheus metrics on the app's own registry (prefix `epd_router_`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epd_kit.router.pools import Pools

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class _PoolCollector(Collector):
    """Per-engine gauges read from the live pool snapshot at scrape time."""

    def __init__(self, pools: Callable[[], Pools]) -> None:
        self._pools = pools

    def collect(self):
        inflight = GaugeMetricFamily(
            "epd_router_engine_inflight", "Requests in flight per engine", labels=["engine", "role"]
        )
        healthy = GaugeMetricFamily(
            "epd_router_engine_healthy", "1 if the engine passes health checks", labels=["engine", "role"]
        )
        draining = GaugeMetricFamily(
            "epd_router_engine_draining", "1 if the engine is draining", labels=["engine", "role"]
        )
        for e in self._pools().all():
            inflight.add_metric([e.id, e.role], e.inflight)
            healthy.add_metric([e.id, e.role], 1.0 if e.healthy else 0.0)
            draining.add_metric([e.id, e.role], 1.0 if e.state.value == "draining" else 0.0)
        yield inflight
        yield healthy
        yield draining


class _PreprocessCollector(Collector):
    """The preprocessor's own cache counters, read at scrape time (one source of truth)."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        for name, attr, doc in (
            ("epd_router_preprocess_cache_hits", "cache_hits", "Preprocessed-image cache hits"),
            ("epd_router_preprocess_cache_misses", "cache_misses", "Preprocessed-image cache misses"),
            ("epd_router_preprocess_inflight_joins", "inflight_joins", "Images shared with a concurrent request"),
            ("epd_router_preprocess_images_downscaled", "images_downscaled", "Images downscaled to the patch budget"),
        ):
            value = getattr(stats, attr, None)
            if isinstance(value, int):
                yield CounterMetricFamily(name, doc, value=value)


class RouterMetrics:
    def __init__(self, pools: Callable[[], Pools], preprocess_stats: Callable[[], Any] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("epd_router_requests", "Chat requests by final HTTP status", ["status"], registry=r)
        self.latency = Histogram(
            "epd_router_request_duration_seconds",
            "Total request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "epd_router_time_to_first_token_seconds",
            "Request arrival to first content byte",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.preprocess = Histogram(
            "epd_router_preprocess_seconds",
            "Rendering and image preprocessing time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.encode = Histogram(
            "epd_router_encode_seconds",
            "VE stage time per request (all VEs, incl. retries)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pd = Histogram(
            "epd_router_pd_seconds",
            "PD stage time per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter("epd_router_retries", "Upstream calls retried", ["stage"], registry=r)
        self.rejections = Counter("epd_router_rejections", "Requests refused by the router", ["reason"], registry=r)
        self.engine_failures = Counter(
            "epd_router_engine_failures",
            "Upstream failures counted against an engine",
            ["engine", "role"],
            registry=r,
        )
        self.dedupe = Counter("epd_router_dedupe_items", "Duplicate media items not re-encoded", registry=r)
        self.items = Counter("epd_router_encode_items", "Unique media items sent to VEs", registry=r)
        self.reloads = Counter("epd_router_config_reloads", "Config reloads by result", ["result"], registry=r)
        self.connections_closed = Counter(
            "epd_router_client_connections_closed",
            "Client connections the listener closed: header_timeout, body_timeout, over_capacity, malformed",
            ["reason"],
            registry=r,
        )
        r.register(_PoolCollector(pools))
        r.register(_PreprocessCollector(preprocess_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track_request(self) -> RequestOutcome:
        return RequestOutcome(self)


class RequestOutcome:
    """How one chat request ended: the one place `requests_total`, the request duration and
    the time to first byte are recorded, once per request, from its arrival.

    `status` is an HTTP status, `stream_error` (a stream failed after it started) or
    `client_closed`, which is also what a request that ends without a verdict was."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.started = time.monotonic()
        self.status = "client_closed"
        self._first_byte_s: float | None = None
        self._recorded = False

    def first_byte(self) -> None:
        if self._first_byte_s is None:
            self._first_byte_s = time.monotonic() - self.started

    def record(self, status: str | None = None) -> None:
        if self._recorded:
            return
        self._recorded = True
        if status is not None:
            self.status = status
        self._metrics.requests.labels(self.status).inc()
        self._metrics.latency.observe(time.monotonic() - self.started)
        if self._first_byte_s is not None:
            self._metrics.ttft.observe(self._first_byte_s)
