"""Saved-scrape fixtures for the advisor's tests, written by the router's own metrics code.

A seeded discrete-event run of the two pools (FIFO, c servers each, exponential service times:
the model the advisor states) records every request into a real RouterMetrics; its /metrics text
is saved before and after the window, as `epd-router advise --save` would.
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from epd_kit.router.metrics import RouterMetrics

PREPROCESS_S = 0.005


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s
    image_share: float
    ve_service_s: float
    pd_service_s: float
    num_ve: int
    num_pd: int
    pd_slots: int = 8
    seconds: float = 120.0
    warmup_s: float = 20.0
    seed: int = 7
    cache_hit_share: float = 0.0  # of the image requests, those whose image the preprocess cache held


class _Servers:
    """c servers, FIFO: a request starts when the earliest server frees up."""

    def __init__(self, count: int) -> None:
        self._free = [0.0] * count
        heapq.heapify(self._free)

    def serve(self, arrival: float, service: float) -> float:
        start = max(arrival, heapq.heappop(self._free))
        heapq.heappush(self._free, start + service)
        return start + service


MODEL = "/models/Qwen3-VL-32B-Instruct"  # write_inventory's epd_model: the one model's served name


def _engines(load: Load, model: str, prefix: str) -> list[SimpleNamespace]:
    def engine(role: str, n: int) -> SimpleNamespace:
        return SimpleNamespace(
            id=f"epd-{prefix}{role}-{n}",
            role=role,
            model=model,
            inflight=0,
            healthy=True,
            state=SimpleNamespace(value="active"),
        )

    return [engine("ve", n) for n in range(load.num_ve)] + [engine("pd", n) for n in range(load.num_pd)]


@dataclass(frozen=True)
class _Request:
    arrival: float
    encode_s: float | None  # None: no image
    pd_s: float
    ttft_s: float
    latency_s: float


def _simulate(load: Load) -> list[_Request]:
    rng = random.Random(load.seed)
    ve, pd = _Servers(load.num_ve), _Servers(load.num_pd * load.pd_slots)
    arrival, end = 0.0, load.warmup_s + load.seconds
    out = []
    while True:
        arrival += rng.expovariate(load.rate)
        if arrival >= end:
            return out
        ready = arrival + PREPROCESS_S
        encode_s = None
        if rng.random() < load.image_share:
            encoded = ve.serve(ready, rng.expovariate(1 / load.ve_service_s))
            encode_s = encoded - ready
            ready = encoded
        service = rng.expovariate(1 / load.pd_service_s)
        done = pd.serve(ready, service)
        # first token after the prefill part
        out.append(_Request(arrival, encode_s, done - ready, done - service * 0.8 - arrival, done - arrival))


def write_scrapes(load: Load, directory: Path, first: str = MODEL, **more: Load) -> tuple[Path, Path]:
    """before.prom (after the warm-up) and after.prom (`seconds` later): `load` as the model
    served as `first`, and each of `more` as a further model of that name (its engines
    epd-<name>-pd-0 ...), on one router's metrics. The window is `load`'s."""
    models = {first: ("", load), **{name: (f"{name}-", extra) for name, extra in more.items()}}
    engines = [e for name, (prefix, m) in models.items() for e in _engines(m, name, prefix)]
    # each model's renderer's cache counters (the preprocessor's PreprocessStats fields read)
    caches = {name: SimpleNamespace(cache_hits=0, cache_misses=0, owed=0.0) for name in models}
    metrics = RouterMetrics(lambda: SimpleNamespace(all=lambda: engines), lambda: caches)
    requests = sorted(
        ((r, name) for name, (_, m) in models.items() for r in _simulate(m)), key=lambda item: item[0].arrival
    )
    before_text = None
    for request, name in requests:
        if before_text is None and request.arrival >= load.warmup_s:
            before_text = metrics.render().decode()
        series = metrics.for_model(name)
        series.preprocess.observe(PREPROCESS_S)
        if request.encode_s is not None:
            series.encode.observe(request.encode_s)
            series.items.inc()
            cache = caches[name]
            cache.owed += models[name][1].cache_hit_share
            if cache.owed >= 1:
                cache.owed -= 1
                cache.cache_hits += 1
            else:
                cache.cache_misses += 1
        series.pd.observe(request.pd_s)
        series.ttft.observe(request.ttft_s)
        series.latency.observe(request.latency_s)
        series.requests("200").inc()
    directory.mkdir(parents=True, exist_ok=True)
    before, after = directory / "before.prom", directory / "after.prom"
    before.write_text(before_text or "")
    after.write_text(metrics.render().decode())
    return before, after


def write_inventory(path: Path, hosts: dict[str, tuple[int, int]], **group_vars) -> Path:
    """An `ansible-inventory --list` document: engine hosts with their counts, sim backend."""
    common = {
        "epd_model": MODEL,
        "epd_engine_backend": "sim",
        "epd_client_networks": ["10.213.0.1/32"],  # several machines: the access rules need them
        **group_vars,
    }
    hostvars = {}
    for index, (name, (ve, pd)) in enumerate(hosts.items()):
        hostvars[name] = {
            **common,
            "ansible_host": f"10.213.0.{11 + index}",
            "epd_num_ve": ve,
            "epd_num_pd": pd,
            "epd_bind_address": f"10.213.0.{11 + index}",
        }
    doc = {
        "_meta": {"hostvars": hostvars},
        "all": {"children": ["ungrouped", "epd_engines", "epd_router"]},
        "epd_engines": {"hosts": list(hosts)},
        "epd_router": {"hosts": [next(iter(hosts))]},
    }
    path.write_text(json.dumps(doc))
    return path


def run_advise(before: Path, after: Path, seconds: float, inventory: Path, *extra: str) -> tuple[dict, str]:
    """`epd-router advise` on saved scrapes: its --json document and its printed report."""
    from click.testing import CliRunner

    from epd_kit.cli import main

    args = ["advise", "--before", str(before), "--after", str(after), "--window", str(seconds)]
    args += ["--inventory", str(inventory), *extra]
    runner = CliRunner()
    as_json = runner.invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    return json.loads(as_json.output), text.output
