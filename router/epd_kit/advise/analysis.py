"""Per-pool figures, the share of TTFT per stage, the verdict and how far the window supports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from epd_kit.plan import ROLES
from epd_kit.router_yaml import Placement

from .queueing import PoolModel, fit_service_time
from .scrape import ScrapeError
from .window import EngineSeen, HistogramDelta, Window

R = "epd_router_"
# Below this a pool is not a bottleneck, whatever the ranking says.
BUSY_THRESHOLD = 0.5
DEFAULT_MIN_REQUESTS = 100
# the router's own default (router.yaml placement.pd_max_inflight), for a fleet that keeps it
DEFAULT_PD_MAX_INFLIGHT: int = Placement.model_fields["pd_max_inflight"].default
# The busy fraction a recommendation brings the busiest pool to or under (--target-busy).
DEFAULT_TARGET_BUSY = 0.70
# The latency target beside it (--target-queueing): the share of a pool's time in stage that its
# requests may spend queueing in front of it. 0.5 = queueing no longer than service: a pool whose
# requests wait longer than they are served is acted on whatever its busy fraction (one VE 68 %
# busy queues 2.1x its service time under M/M/1, issue 55).
DEFAULT_TARGET_QUEUEING = 0.5
# A pool whose own estimate rests on fewer arrivals than this is reported but not acted on.
MIN_POOL_ARRIVALS = 30


@dataclass(frozen=True)
class PoolFigures:
    role: str
    engines: int  # active (healthy, not draining) at the second scrape
    slots_per_engine: int  # requests one engine serves at once
    arrivals: float  # requests that finished the stage inside the window
    time_in_stage_s: float | None  # measured mean (service + queueing)
    model: PoolModel  # fitted: its service time gives the measured mean time in stage
    inflight_mean: float  # Little's law: sum of stage times / window
    inflight_scraped: tuple[float, float]  # the router's gauge at the two scrapes
    cap: int | None  # the router's admission cap (PD: engines x placement.pd_max_inflight)

    @property
    def servers(self) -> int:
        return self.engines * self.slots_per_engine

    @property
    def busy(self) -> float:
        return self.model.utilisation

    @property
    def queueing_s(self) -> float:
        return max(0.0, (self.time_in_stage_s or 0.0) - self.model.service_s)

    @property
    def queueing_share(self) -> float:
        """The share of the measured time in stage spent queueing (0 when nothing was measured)."""
        return self.queueing_s / self.time_in_stage_s if self.time_in_stage_s else 0.0

    @property
    def usable(self) -> bool:
        """Figures the advisor acts on: engines to act on and enough arrivals to trust."""
        return self.arrivals >= MIN_POOL_ARRIVALS and self.engines > 0


@dataclass(frozen=True)
class EngineFigures:
    """What scraped engines say of themselves, from vLLM's own series (docs/observability.md
    "Engine metrics the kit reads"): requests they finished and the time those waited in the
    engine's scheduler queue. vLLM exports no encoder-cache counter, so there is no VE cache
    figure here."""

    requests: float  # vllm:request_success_total
    queue_wait: HistogramDelta  # vllm:request_queue_time_seconds


@dataclass(frozen=True)
class Stages:
    """Mean seconds per request from arrival to first token, split by stage."""

    preprocess_s: float
    encode_s: float  # averaged over all requests (text-only ones spend 0 here)
    pd_first_token_s: float  # the rest: PD admission wait, prefill, the first token's way back
    ttft_s: float

    def shares(self) -> dict[str, float]:
        if self.ttft_s <= 0:
            return {"preprocess": 0.0, "encode": 0.0, "pd": 0.0}
        return {
            "preprocess": self.preprocess_s / self.ttft_s,
            "encode": self.encode_s / self.ttft_s,
            "pd": self.pd_first_token_s / self.ttft_s,
        }


@dataclass(frozen=True)
class Analysis:
    seconds: float
    requests: float
    failed: float  # finished with a status other than 200
    rejections: dict[str, float]
    image_requests: float
    stages: Stages
    ttft: HistogramDelta
    latency: HistogramDelta
    pools: dict[str, PoolFigures]
    preprocess_cache_hit: float | None
    dedupe_share: float | None  # duplicate items in a request not encoded again
    # by role when the series carry Prometheus's `role` target label, else "all" (engines
    # scraped with --engine-url); empty when no engine was scraped
    engines: dict[str, EngineFigures]
    min_requests: int
    notes: list[str] = field(default_factory=list)
    model: str | None = None  # the served name these figures are of (None: the fleet's one model)

    @property
    def enough_traffic(self) -> bool:
        return self.requests >= self.min_requests

    @property
    def relative_error(self) -> float:
        """Rough relative standard error of a mean time: 1/sqrt(n), exponential times assumed."""
        return 1 / math.sqrt(self.requests) if self.requests > 0 else math.inf

    @property
    def bottleneck(self) -> str | None:
        """The busiest pool, if it is busy enough to bound latency and throughput."""
        usable = [p for p in self.pools.values() if p.usable]
        if not self.enough_traffic or not usable:
            return None
        busiest = max(usable, key=lambda p: p.busy)
        return busiest.role if busiest.busy >= BUSY_THRESHOLD else None

    def waiting(self, target_queueing: float = DEFAULT_TARGET_QUEUEING) -> list[PoolFigures]:
        """The pools whose requests spend more than `target_queueing` of their time in stage
        queueing (measured time in stage minus fitted service), busiest first; none without a
        verdict. At the default target (queueing above service) such a pool is over 50 % busy
        under M/M/c (M/M/1: queueing share = busy fraction), so never below the verdict's
        threshold."""
        if not self.enough_traffic:
            return []
        over = [p for p in self.pools.values() if p.usable and p.queueing_share > target_queueing]
        return sorted(over, key=lambda p: -p.busy)

    def confidence(self) -> str:
        if not self.enough_traffic:
            return (
                f"too little traffic: {self.requests:.0f} requests in {self.seconds:.0f} s, fewer than the "
                f"{self.min_requests} a verdict needs; take a longer window or one under load. Nothing is recommended."
            )
        level = "high" if self.relative_error <= 0.05 else "medium"
        text = f"{level}: {self.requests:.0f} requests, mean times known to about +-{self.relative_error:.0%}"
        thin = [p.role.upper() for p in self.pools.values() if 0 < p.arrivals < MIN_POOL_ARRIVALS]
        if thin:
            text += f"; the {', '.join(thin)} figures rest on fewer than {MIN_POOL_ARRIVALS} requests"
        return text

    def verdict(self) -> str:
        if not self.enough_traffic:
            return "no verdict: " + self.confidence()
        shares = self.stages.shares()
        role = self.bottleneck
        if role is None:
            stage = max(shares, key=lambda s: shares[s])
            return (
                f"no pool is busy (busiest at {max(p.busy for p in self.pools.values()):.0%}, below "
                f"{BUSY_THRESHOLD:.0%}): latency is service time, the largest share of TTFT is {stage} "
                f"({shares[stage]:.0%}); a different split would not make requests faster"
            )
        pool = self.pools[role]
        stage = "encode" if role == "ve" else "pd"
        unit = ("engine" if role == "ve" else "slot") + ("s" if pool.servers != 1 else "")
        return (
            f"the {role.upper()} pool bounds latency and throughput: {pool.busy:.0%} busy over "
            f"{pool.servers} {unit}, {pool.queueing_s:.3f} s queueing in front of it "
            f"per request there, {shares[stage]:.0%} of TTFT spent in {stage}; it completes at most "
            f"{pool.model.capacity_per_s:.1f} {'image ' if role == 've' else ''}requests/s"
        )


def _pool(
    seen: list[EngineSeen], window: Window, role: str, hist: HistogramDelta, engines: int, slots: int, cap: int | None
) -> PoolFigures:
    seen = [e for e in seen if e.role == role]
    rate = hist.count / window.seconds
    measured = hist.mean
    servers = engines * slots
    service = fit_service_time(rate, measured, servers) if measured is not None else 0.0
    return PoolFigures(
        role=role,
        engines=engines,
        slots_per_engine=slots,
        arrivals=hist.count,
        time_in_stage_s=measured,
        model=PoolModel(rate, service, servers),
        inflight_mean=hist.total / window.seconds,
        inflight_scraped=(sum(e.inflight_before for e in seen), sum(e.inflight_after for e in seen)),
        cap=cap,
    )


def _engines(window: Window, match: dict[str, str]) -> dict[str, EngineFigures]:
    success, queue = "vllm:request_success_total", "vllm:request_queue_time_seconds"
    series = [dict(labels) for labels in window.after.series(success)]
    labelled = {labels.get("role") for labels in series if match.items() <= labels.items()}
    if not labelled:
        return {}
    groups = [role for role in ROLES if role in labelled] if labelled <= set(ROLES) else ["all"]
    return {
        group: EngineFigures(
            window.counter(success, **match, **({} if group == "all" else {"role": group})),
            window.histogram(queue, **match, **({} if group == "all" else {"role": group})),
        )
        for group in groups
    }


def _engines_or_note(window: Window, match: dict[str, str] | None, notes: list[str]) -> dict[str, EngineFigures]:
    if match is None:
        notes.append(
            "the engines' own figures are left out: vLLM labels its series by checkpoint (model_name), and "
            "another model of this fleet runs the same checkpoint"
        )
        return {}
    try:
        return _engines(window, match)
    except ScrapeError:  # an engine's counters went down: it restarted inside the window
        notes.append("an engine restarted inside the window: the engines' own figures are left out")
        return {}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def analyse(
    window: Window,
    pd_slots: int,
    pd_max_inflight: int = DEFAULT_PD_MAX_INFLIGHT,
    min_requests: int = DEFAULT_MIN_REQUESTS,
    engines: dict[str, int] | None = None,
    *,
    model: str | None = None,
    engine_match: dict[str, str] | None = None,
) -> Analysis:
    """The window's figures. pd_slots: epd_max_num_seqs; pd_max_inflight: the router's
    placement.pd_max_inflight; engines: active engines per pool (default: what the router saw).

    Several models: `model` is the served name whose series (the router's `model` label) and
    engines are read, the rest left out; `engine_match` selects that model's series among the
    engines' own (vLLM's `model_name`, the checkpoint; None: they cannot be told apart, left out).
    None and the defaults: every series, as one model."""
    match = {} if model is None else {"model": model}
    seen = window.engines(model)
    active = engines or {role: sum(1 for e in seen if e.role == role and e.active) for role in ROLES}
    statuses = window.by_label(f"{R}requests_total", "status", **match)
    requests = sum(statuses.values())
    preprocess = window.histogram(f"{R}preprocess_seconds", **match)
    encode = window.histogram(f"{R}encode_seconds", **match)
    pd = window.histogram(f"{R}pd_seconds", **match)
    ttft = window.histogram(f"{R}time_to_first_token_seconds", **match)
    per_request = max(preprocess.count, 1.0)
    pre_s = preprocess.mean or 0.0
    enc_s = encode.total / per_request
    ttft_s = ttft.mean or 0.0
    stages = Stages(pre_s, enc_s, max(0.0, ttft_s - pre_s - enc_s), ttft_s)
    notes = []
    if requests and sum(v for s, v in statuses.items() if s != "200") / requests > 0.05:
        notes.append("more than 5% of the requests failed: the fitted times may not describe healthy service")
    missing = [role.upper() for role in ROLES if active[role] == 0]
    if missing:
        notes.append(f"no active {' or '.join(missing)} engine at the second scrape")
    hits = window.counter(f"{R}preprocess_cache_hits_total", **match)
    misses = window.counter(f"{R}preprocess_cache_misses_total", **match)
    items, dedupe = window.counter(f"{R}encode_items_total", **match), window.counter(f"{R}dedupe_items_total", **match)
    return Analysis(
        seconds=window.seconds,
        requests=requests,
        failed=sum(v for s, v in statuses.items() if s != "200"),
        rejections={k: v for k, v in window.by_label(f"{R}rejections_total", "reason", **match).items() if v > 0},
        image_requests=encode.count,
        stages=stages,
        ttft=ttft,
        latency=window.histogram(f"{R}request_duration_seconds", **match),
        pools={
            "ve": _pool(seen, window, "ve", encode, active["ve"], 1, None),
            "pd": _pool(
                seen, window, "pd", pd, active["pd"], min(pd_slots, pd_max_inflight), active["pd"] * pd_max_inflight
            ),
        },
        preprocess_cache_hit=_ratio(hits, hits + misses),
        dedupe_share=_ratio(dedupe, items + dedupe),
        engines=_engines_or_note(window, {} if model is None else engine_match, notes),
        min_requests=min_requests,
        notes=notes,
        model=model,
    )
