"""Prometheus metrics on the app's own registry (prefix `epd_router_`).

Several router processes behind one listener (docs/router.md "Scale-out") share their metrics
through prometheus_client's multiprocess mode: with `PROMETHEUS_MULTIPROC_DIR` set (the unit
sets it), every counter and histogram lives in memory-mapped files there and any process's
/metrics sums them all. The files are keyed by the worker's name (`use_worker_files`), not by
PID, so a restarted worker continues its own counters instead of leaving a dead file behind.
Values read from the live state at scrape time (per-engine gauges, each model's preprocessor's
cache counters) are copied into shared series by `publish()`, which each process runs every second.

Several models (docs/router.md "Several models"): the series of a request's path carry a
`model` label whose value is a served name from the config, or NO_MODEL (`_none`) for a
request refused before its model was known (unreadable body, bad key, unknown model); no served
name starts with "_" (plan/models.py RESERVED_PREFIX). The client's own `model` string never
becomes a label value, so the series stay bounded by the config. The per-engine series carry
their engine's model too (an engine serves one model).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from epd_kit.plan.models import NO_MODEL  # the one spelling: the planner and the config refuse it as a name
from epd_kit.router.pools import Engine, Pools
from epd_kit.router_yaml import EngineState

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


@dataclass(frozen=True)
class _EngineGauge:
    name: str
    doc: str
    group_mode: str  # how the processes' values combine (prometheus_client multiprocess_mode)
    value: Callable[[Engine], float]

    @property
    def key(self) -> str:
        """Its field in RouterMetrics.group_engines: the name without the prefix."""
        return self.name.removeprefix("epd_router_engine_")


# Per-engine gauges, in publishing order: the counts before the state, so a process that reads
# another's new state also reads the counts that go with it (RouterMetrics.group_engines)
_ENGINE_GAUGES = (
    _EngineGauge("epd_router_engine_inflight", "Requests in flight per engine", "livesum", lambda e: e.inflight),
    _EngineGauge(
        "epd_router_engine_healthy",
        "1 if the engine passes health checks",
        "livemin",
        lambda e: float(e.healthy),
    ),
    _EngineGauge(
        "epd_router_engine_draining",
        "1 if the engine is draining",
        "livemax",
        lambda e: float(e.state is EngineState.draining),
    ),
    _EngineGauge(
        "epd_router_engine_active",
        "1 if the engine takes new work (configured active, not draining) in some router process",
        "livemax",
        lambda e: float(e.state is EngineState.active),
    ),
)


class _PoolCollector(Collector):
    """Per-engine gauges read from the live pool snapshot at scrape time."""

    def __init__(self, pools: Callable[[], Pools]) -> None:
        self._pools = pools

    def collect(self):
        engines = self._pools().all()
        for gauge in _ENGINE_GAUGES:
            family = GaugeMetricFamily(gauge.name, gauge.doc, labels=["engine", "role", "model"])
            for e in engines:
                family.add_metric([e.id, e.role, e.model], gauge.value(e))
            yield family


# {served name: its renderer's PreprocessStats (cache_hits, cache_misses, ...)}, read at scrape time
PreprocessStatsByModel = Callable[[], Mapping[str, Any]]


class _PreprocessCollector(Collector):
    """Each model's preprocessor's own cache counters, read at scrape time (one source of truth)."""

    def __init__(self, stats: PreprocessStatsByModel) -> None:
        self._stats = stats

    def collect(self):
        by_model = self._stats()
        for name, attr, doc in _PREPROCESS_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model, stats in by_model.items():
                value = getattr(stats, attr, None)
                if isinstance(value, int):
                    family.add_metric([model], value)
            if family.samples:
                yield family


_PREPROCESS_COUNTERS = (
    ("epd_router_preprocess_cache_hits", "cache_hits", "Preprocessed-image cache hits"),
    ("epd_router_preprocess_cache_misses", "cache_misses", "Preprocessed-image cache misses"),
    ("epd_router_preprocess_inflight_joins", "inflight_joins", "Images shared with a concurrent request"),
    ("epd_router_preprocess_images_downscaled", "images_downscaled", "Images downscaled to the patch budget"),
)


def shared_metrics_dir() -> Path | None:
    """The multiprocess directory, when this process shares its metrics with others."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(path) if path else None


def use_worker_files(worker: str) -> None:
    """Key this process's metric files by `worker` (unique among the running processes) and
    drop the live gauges a previous run of the same worker left (it may have been killed).
    Process-wide by prometheus_client's design: call it once, before any metric exists."""
    directory = shared_metrics_dir()
    if directory is None:
        return
    multiprocess.mark_process_dead(worker, str(directory))
    values.ValueClass = values.MultiProcessValue(lambda: worker)


def forget_worker(worker: str) -> None:
    """A stopping worker's live gauges (in-flight counts) leave the sums; its counters stay."""
    directory = shared_metrics_dir()
    if directory is not None:
        multiprocess.mark_process_dead(worker, str(directory))


class _SharedLiveValues:
    """The per-process live values as shared series: engine gauges summed (in flight) or
    combined (healthy: every process sees it so; draining, active: any process has it so),
    cache counters as increments since the last publish."""

    def __init__(self, pools: Callable[[], Pools], preprocess_stats: PreprocessStatsByModel, registry) -> None:
        self._pools = pools
        self._stats = preprocess_stats
        self._engine_gauges = [
            (
                Gauge(g.name, g.doc, ["engine", "role", "model"], multiprocess_mode=g.group_mode, registry=registry),
                g.value,
            )
            for g in _ENGINE_GAUGES
        ]
        self._counters = {
            attr: Counter(name, doc, ["model"], registry=registry) for name, attr, doc in _PREPROCESS_COUNTERS
        }
        self._published: dict[tuple[str, str], int] = {}

    def publish(self) -> None:
        for e in self._pools().all():
            for gauge, value in self._engine_gauges:
                gauge.labels(e.id, e.role, e.model).set(value(e))
        for model, stats in self._stats().items():
            for attr, counter in self._counters.items():
                value = getattr(stats, attr, None)
                if isinstance(value, int):
                    counter.labels(model).inc(max(0, value - self._published.get((model, attr), 0)))
                    self._published[(model, attr)] = value


@dataclass(frozen=True)
class EngineGroupView:
    """One engine as the whole group of router processes sees it."""

    inflight: int  # the sum over the processes
    healthy: bool  # every process sees it healthy
    state: str  # "active" or "draining" when every process agrees, else "reloading"


def _group_state(active_somewhere: bool, draining_somewhere: bool) -> str:
    if active_somewhere and draining_somewhere:
        return "reloading"  # a reload reached some processes only
    return "draining" if draining_somewhere else "active"


FamilyFilter = Callable[[Iterable[Metric]], Iterable[Metric]]


class _Filtered:
    """A registry's families through `filters`, as generate_latest reads them."""

    def __init__(self, source: CollectorRegistry, filters: list[FamilyFilter]) -> None:
        self._source = source
        self._filters = filters

    def collect(self) -> Iterable[Metric]:
        families: Iterable[Metric] = self._source.collect()
        for keep in self._filters:
            families = keep(families)
        return families


class RouterMetrics:
    def __init__(self, pools: Callable[[], Pools], preprocess_stats: PreprocessStatsByModel = dict) -> None:
        """`preprocess_stats`: each model's renderer's cache counters, by served name (the
        `model` label of the epd_router_preprocess_* counters)."""
        self.registry = CollectorRegistry()
        self.shared_dir = shared_metrics_dir()
        # what /metrics passes its families through (the tenants' label cap, tenants.py)
        self.family_filters: list[FamilyFilter] = []
        r = self.registry
        self.requests = Counter(
            "epd_router_requests", "Chat requests by final HTTP status", ["status", "model"], registry=r
        )
        self.latency = Histogram(
            "epd_router_request_duration_seconds",
            "Total request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "epd_router_time_to_first_token_seconds",
            "Request arrival to first content byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.preprocess = Histogram(
            "epd_router_preprocess_seconds",
            "Rendering and image preprocessing time",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.encode = Histogram(
            "epd_router_encode_seconds",
            "VE stage time per request (all VEs, incl. retries)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pd = Histogram(
            "epd_router_pd_seconds",
            "PD stage time per request",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter("epd_router_retries", "Upstream calls retried", ["stage", "model"], registry=r)
        self.rejections = Counter(
            "epd_router_rejections", "Requests refused by the router", ["reason", "model"], registry=r
        )
        self.engine_failures = Counter(
            "epd_router_engine_failures",
            "Upstream failures counted against an engine",
            ["engine", "role"],
            registry=r,
        )
        self.engine_quarantines = Counter(
            "epd_router_engine_quarantines",
            "VEs taken out of service because a PD could not read their blocks (ECLoadFailure)",
            ["engine"],
            registry=r,
        )
        self.malformed_frames = Counter(
            "epd_router_pd_stream_malformed_frames",
            "PD stream events skipped as malformed (not JSON, not an object, bad fields)",
            ["model"],
            registry=r,
        )
        self.dedupe = Counter("epd_router_dedupe_items", "Duplicate media items not re-encoded", ["model"], registry=r)
        self.items = Counter("epd_router_encode_items", "Unique media items sent to VEs", ["model"], registry=r)
        self._models: dict[str, ModelMetrics] = {}
        self.reloads = Counter("epd_router_config_reloads", "Config reloads by result", ["result"], registry=r)
        # tracing.py: counted, never logged per request (a client controls these headers)
        self.trace_context_errors = Counter(
            "epd_router_trace_context_errors",
            "Client traceparent/tracestate headers ignored as invalid, by header",
            ["header"],
            registry=r,
        )
        self.trace_spans_dropped = Counter(
            "epd_router_trace_spans_dropped",
            "Spans dropped because the export queue was full (the collector is slow or gone)",
            registry=r,
        )
        self.connections_closed = Counter(
            "epd_router_client_connections_closed",
            "Client connections the listener closed: header_timeout, body_timeout, over_capacity, malformed,"
            " write_stalled",
            ["reason"],
            registry=r,
        )
        if self.shared_dir is None:
            r.register(_PoolCollector(pools))
            r.register(_PreprocessCollector(preprocess_stats))
            self._shared_live = None
        else:
            self._shared_live = _SharedLiveValues(pools, preprocess_stats, r)

    def publish(self) -> None:
        """Copy this process's live values into the shared series (multiprocess mode only)."""
        if self._shared_live is not None:
            self._shared_live.publish()

    def group_engines(self) -> dict[str, EngineGroupView] | None:
        """Every live router process's view of each engine, combined (None with one process):
        what `/pools` answers, so a drain that asks any one process sees the whole group."""
        if self.shared_dir is None:
            return None
        self.publish()  # this process's own values, current
        # only the live gauges' files: the counters and histograms are not needed here
        files = [str(path) for path in self.shared_dir.glob("gauge_live*.db")]
        keys = {gauge.name: gauge.key for gauge in _ENGINE_GAUGES}
        seen: dict[str, dict[str, float]] = {}
        for family in multiprocess.MultiProcessCollector.merge(files, accumulate=False):
            field = keys.get(family.name)
            if field is not None:
                for sample in family.samples:
                    seen.setdefault(sample.labels["engine"], {})[field] = sample.value
        return {
            engine: EngineGroupView(
                inflight=int(v.get("inflight", 0)),
                healthy=v.get("healthy", 0) == 1,
                state=_group_state(v.get("active", 0) == 1, v.get("draining", 0) == 1),
            )
            for engine, v in seen.items()
        }

    def render(self) -> bytes:
        if self.shared_dir is None:
            return generate_latest(_Filtered(self.registry, self.family_filters))
        self.publish()
        fleet = CollectorRegistry()
        multiprocess.MultiProcessCollector(fleet, str(self.shared_dir))
        return generate_latest(_Filtered(fleet, self.family_filters))

    def for_model(self, model: str) -> ModelMetrics:
        """One model's children of the per-model series (`model`: a served name from the config
        or NO_MODEL, never a client's string), looked up once per model."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def track_request(self) -> RequestOutcome:
        return RequestOutcome(self)


class ModelMetrics:
    """The series one model's requests record into, labelled once: a label lookup takes a lock
    and validates the labels every time, so the labelled children are kept (per status,
    reason and stage as they first occur)."""

    def __init__(self, metrics: RouterMetrics, model: str) -> None:
        self._metrics = metrics
        self.model = model
        self.latency = metrics.latency.labels(model=model)
        self.ttft = metrics.ttft.labels(model=model)
        self.preprocess = metrics.preprocess.labels(model=model)
        self.encode = metrics.encode.labels(model=model)
        self.pd = metrics.pd.labels(model=model)
        self.items = metrics.items.labels(model=model)
        self.dedupe = metrics.dedupe.labels(model=model)
        self.malformed_frames = metrics.malformed_frames.labels(model=model)
        self._children: dict[tuple[str, str], Any] = {}

    def _child(self, family: Any, kind: str, value: str) -> Any:
        child = self._children.get((kind, value))
        if child is None:
            child = self._children[(kind, value)] = family.labels(value, self.model)
        return child

    def requests(self, status: str) -> Any:
        return self._child(self._metrics.requests, "status", status)

    def rejected(self, reason: str) -> None:
        self._child(self._metrics.rejections, "reason", reason).inc()

    def retried(self, stage: str) -> None:
        self._child(self._metrics.retries, "stage", stage).inc()


class RequestOutcome:
    """How one chat request ended: the one place `requests_total`, the request duration and
    the time to first byte are recorded, once per request, from its arrival.

    `status` is an HTTP status, `stream_error` (a stream failed after it started) or
    `client_closed`, which is also what a request that ends without a verdict was. `model` is
    the served name of the lane that took the request, NO_MODEL until one did."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.started = time.monotonic()
        self.status = "client_closed"
        self.model = NO_MODEL
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
        series = self._metrics.for_model(self.model)
        series.requests(self.status).inc()
        series.latency.observe(time.monotonic() - self.started)
        if self._first_byte_s is not None:
            series.ttft.observe(self._first_byte_s)
