"""`epd-router advise`: two scrapes N seconds apart -> figures, verdict, a layout the planner accepts.

epd-router advise --url http://10.0.0.5:18800 --window 120 --inventory inventory/prod
epd-router advise --prometheus http://prom:9090 --window 600 --inventory inv.json
epd-router advise --before t0.prom --after t1.prom --window 120 --inventory inv.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import click

from .analysis import DEFAULT_MIN_REQUESTS, DEFAULT_PD_MAX_INFLIGHT, DEFAULT_TARGET_BUSY, DEFAULT_TARGET_QUEUEING

# The rest is imported when the command runs: `epd-router serve` loads this module too (epd_kit/cli.py).

MAX_WINDOW_S = 3600  # a live window sleeps this long at most


def _faulted(values: tuple[str, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for value in values:
        host, _, cores = value.partition("=")
        try:
            out[host] = [int(c) for c in cores.split(",") if c.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r}: give HOST=CORE,CORE (e.g. n1=3,7)", param_hint="--faulted") from None
        if not host:
            raise click.BadParameter(f"{value!r}: give HOST=CORE,CORE (e.g. n1=3,7)", param_hint="--faulted")
    return out


def _save(directory: Path | None, name: str, texts: dict[str, str]) -> None:
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(texts.values()):
        (directory / f"{name}-{index}.prom").write_text(text)


def _live(urls: list[str], window: float, save: Path | None):
    from .scrape import fetch_urls

    first, texts = fetch_urls(urls)
    _save(save, "before", texts)
    click.echo(f"scraped {len(urls)} source(s); waiting {window:.0f} s for the second scrape", err=True)
    time.sleep(window)
    second, texts = fetch_urls(urls)
    _save(save, "after", texts)
    return first, second, (second.at or 0) - (first.at or 0)


@click.command("advise")
@click.option("--url", "urls", multiple=True, metavar="URL", help="a router's base URL (repeat for every router host)")
@click.option(
    "--engine-url",
    "engine_urls",
    multiple=True,
    metavar="URL",
    help="an engine's base URL (its requests and queue wait)",
)
@click.option("--prometheus", metavar="URL", help="a Prometheus server scraping the routers (and engines)")
@click.option("--before", "before_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--after", "after_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--window", type=float, required=True, help="seconds between the two scrapes")
@click.option("--at", "end", type=float, default=None, help="--prometheus: the window's end (unix s) [now]")
@click.option(
    "--inventory",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="the fleet's inventory (ansible-inventory reads it) or a saved `ansible-inventory --list` JSON",
)
@click.option("--faulted", multiple=True, metavar="HOST=CORES", help="faulted NeuronCores of a host (e.g. n1=3,7)")
@click.option(
    "--pd-max-inflight",
    type=int,
    default=DEFAULT_PD_MAX_INFLIGHT,
    show_default=True,
    help="the router's placement.pd_max_inflight",
)
@click.option("--min-requests", type=int, default=DEFAULT_MIN_REQUESTS, show_default=True)
@click.option(
    "--target-busy",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_TARGET_BUSY,
    show_default=True,
    help="recommend the fewest engine changes that bring the busiest pool to or under this busy fraction",
)
@click.option(
    "--target-queueing",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_TARGET_QUEUEING,
    show_default=True,
    help="... and every pool's requests to or under this share of their time in it spent queueing (0.5: no "
    "longer than service)",
)
@click.option("--save", type=click.Path(file_okay=False, path_type=Path), help="live: keep the scrapes here")
@click.option("--json", "as_json", is_flag=True, help="the figures and the recommendation as JSON")
def advise(
    urls, engine_urls, prometheus, before_files, after_files, window, end, inventory, faulted, pd_max_inflight,
    min_requests, target_busy, target_queueing, save, as_json,
) -> None:  # fmt: skip
    """Which stage bounds latency, and which VE:PD split of the same hosts fixes it (reads only)."""
    sources = sum(bool(x) for x in (urls, prometheus, before_files or after_files))
    if sources != 1:
        raise click.UsageError("give exactly one source: --url (live), --prometheus, or --before/--after files")
    if bool(before_files) != bool(after_files):
        raise click.UsageError("saved scrapes need both --before and --after")
    if not 0 < window <= MAX_WINDOW_S:
        raise click.UsageError(f"--window must be in (0, {MAX_WINDOW_S}] seconds")
    from epd_kit.plan import EpdPlanError
    from epd_kit.router.metrics import NO_MODEL

    from .layout import Advisor, InventoryError, load_inventory
    from .report import analysis_lines, recommendation_lines
    from .scrape import ScrapeError, prometheus_at, read_files
    from .window import Window

    try:
        advisors = Advisor.per_model(load_inventory(inventory), _faulted(faulted))
        if urls:
            before, after, seconds = _live([*urls, *engine_urls], window, save)
        elif prometheus:
            stop = end if end is not None else time.time()
            before, after, seconds = prometheus_at(prometheus, stop - window), prometheus_at(prometheus, stop), window
        else:
            before, after, seconds = read_files(before_files), read_files(after_files), window
        span = Window(before, after, seconds)
        results = [
            (advisor, *_advise(advisor, advisors, span, pd_max_inflight, min_requests, (target_busy, target_queueing)))
            for advisor in advisors
        ]
    except (ScrapeError, InventoryError, EpdPlanError) as exc:
        click.echo(f"epd-router advise: {exc}", err=True)
        sys.exit(2)
    if len(results) == 1:  # one model: the report of the fleet, as it always was
        _, analysis, rec = results[0]
        if as_json:
            click.echo(json.dumps(_as_dict(analysis, rec), indent=2))
        else:
            click.echo("\n".join(analysis_lines(analysis) + [""] + recommendation_lines(rec)))
        return
    unknown = span.counter("epd_router_requests_total", model=NO_MODEL)
    if as_json:
        doc = {
            "models": {advisor.name: _as_dict(analysis, rec) for advisor, analysis, rec in results},
            "requests_without_model": unknown,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    lines = [
        f"{len(results)} models: {', '.join(a.name for a, _, _ in results)}; each is advised on its own series "
        f"and engines; {unknown:.0f} requests were refused before their model was known (model {NO_MODEL})"
    ]
    for advisor, analysis, rec in results:
        lines += ["", f"=== model {advisor.name} ===", *analysis_lines(analysis), "", *recommendation_lines(rec)]
    click.echo("\n".join(lines))


def _advise(advisor, advisors, window, pd_max_inflight: int, min_requests: int, targets: tuple[float, float]):
    """One model's analysis and recommendation (several models: its own series and engines)."""
    from .analysis import analyse
    from .scrape import ScrapeError

    if len(advisors) == 1:
        analysis = analyse(window, advisor.pd_slots, pd_max_inflight, min_requests)
        return analysis, advisor.recommend(analysis, *targets)
    if not window.label_values("epd_router_requests_total", "model") and window.after.total(
        "epd_router_requests_total"
    ):
        raise ScrapeError(
            "the router's series carry no `model` label (a router older than per-model metrics): a fleet of "
            "several models is advised per model, which needs them; upgrade the router and take the window again"
        )
    checkpoints = [a.checkpoint for a in advisors]
    analysis = analyse(
        window,
        advisor.pd_slots,
        pd_max_inflight,
        min_requests,
        model=advisor.name,
        engine_match=None if checkpoints.count(advisor.checkpoint) > 1 else {"model_name": advisor.checkpoint},
    )
    return analysis, advisor.recommend(analysis, *targets)


def _as_dict(analysis, rec) -> dict:
    pools = {
        role: {
            "engines": p.engines,
            "servers": p.servers,
            "rate_per_s": p.model.rate,
            "busy": p.busy,
            "time_in_stage_s": p.time_in_stage_s,
            "service_s": p.model.service_s,
            "queueing_s": p.queueing_s,
            "queueing_share": p.queueing_share,
            "inflight_mean": p.inflight_mean,
        }
        for role, p in analysis.pools.items()
    }
    out = {
        "model": analysis.model,
        "seconds": analysis.seconds,
        "requests": analysis.requests,
        "enough_traffic": analysis.enough_traffic,
        "bottleneck": analysis.bottleneck,
        "verdict": analysis.verdict(),
        "confidence": analysis.confidence(),
        "ttft_shares": analysis.stages.shares(),
        "ttft_p50_s": analysis.ttft.quantile(0.5),
        "ttft_p99_s": analysis.ttft.quantile(0.99),
        "latency_p50_s": analysis.latency.quantile(0.5),
        "latency_p99_s": analysis.latency.quantile(0.99),
        "pools": pools,
        "engines": {
            group: {"requests": e.requests, "queue_wait_s": e.queue_wait.mean} for group, e in analysis.engines.items()
        },
        "recommendation": None,
    }
    if rec is not None:
        out["recommendation"] = {
            "changed": rec.changed,
            "action": rec.action,
            "current": rec.current.counts,
            "proposed": rec.proposed.counts,
            "inventory_change": rec.inventory_change(),
            "predicted_busy": {"ve": rec.after.ve.utilisation, "pd": rec.after.pd.utilisation},
            "predicted_mean_s": rec.after.mean_s,
            "predicted_queueing_s": {"ve": rec.after.ve.queueing_s, "pd": rec.after.pd.queueing_s},
            "ttft_mean_s": rec.measured_ttft_s,
            "predicted_ttft_mean_s": rec.predicted_ttft_s,
            "reason": rec.reason,
            "target_busy": rec.target,
            "target_queueing": rec.target_queueing,
            "engine_changes": rec.proposed.changes_from(rec.current),
            "headroom": None if math.isinf(rec.headroom) else rec.headroom,
            "next_step": None,
            "refused": rec.refused,
        }
        step = rec.next_step
        if step is not None:
            out["recommendation"]["next_step"] = {
                "at_load": step.load,
                "inventory_change": [] if step.layout is None else step.layout.inventory_change(rec.proposed),
                "predicted_busy": None
                if step.prediction is None
                else {"ve": step.prediction.ve.utilisation, "pd": step.prediction.pd.utilisation},
            }
    return out
