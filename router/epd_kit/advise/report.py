"""The printed report: what the window showed, the verdict, the recommendation."""

from __future__ import annotations

import math

from .analysis import Analysis
from .layout import Recommendation

STAGE_NAMES = {"preprocess": "preprocess (router)", "encode": "encode (VE pool)", "pd": "PD to first token"}


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else ("inf" if math.isinf(value) else f"{value:.0%}")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def analysis_lines(a: Analysis) -> list[str]:
    lines = [
        f"window: {a.seconds:.0f} s, {a.requests:.0f} requests ({a.failed:.0f} not 200), "
        f"{a.image_requests:.0f} with images, {a.requests / a.seconds:.2f} requests/s",
    ]
    if a.rejections:
        lines.append("rejected by the router: " + ", ".join(f"{k} {v:.0f}" for k, v in a.rejections.items()))
    lines.append(
        f"TTFT p50 {_s(a.ttft.quantile(0.5))} s, p99 {_s(a.ttft.quantile(0.99))} s; "
        f"request latency p50 {_s(a.latency.quantile(0.5))} s, p99 {_s(a.latency.quantile(0.99))} s"
    )
    shares = a.stages.shares()
    stage_s = {"preprocess": a.stages.preprocess_s, "encode": a.stages.encode_s, "pd": a.stages.pd_first_token_s}
    rows = [("stage", "mean s/request", "share of TTFT")]
    rows += [(STAGE_NAMES[k], _s(stage_s[k]), _pct(shares[k])) for k in STAGE_NAMES]
    rows.append(("TTFT", _s(a.stages.ttft_s), "100%"))
    lines += [""] + _table(rows)
    rows = [
        (
            "pool",
            "engines",
            "slots",
            "requests/s",
            "busy",
            "in flight: mean/slots (scraped)",
            "cap",
            "time in stage s",
            "service s",
            "queueing s",
        )
    ]
    for p in a.pools.values():
        rows.append(
            (
                p.role.upper(),
                str(p.engines),
                str(p.servers),
                f"{p.model.rate:.2f}",
                _pct(p.busy),
                f"{p.inflight_mean:.1f}/{p.servers} ({p.inflight_scraped[0]:.0f}, {p.inflight_scraped[1]:.0f})",
                "-" if p.cap is None else str(p.cap),
                _s(p.time_in_stage_s),
                _s(p.model.service_s),
                _s(p.queueing_s),
            )
        )
    lines += [""] + _table(rows)
    caches = [
        f"router preprocess cache hit {_pct(a.preprocess_cache_hit)}",
        f"in-request duplicates {_pct(a.dedupe_share)}",
    ]
    lines += ["", "caches: " + "; ".join(caches)]
    if a.engines:
        lines.append(
            "engines (vLLM's own series): "
            + "; ".join(
                f"{group.upper() if group != 'all' else 'all scraped'} {e.requests:.0f} requests finished, "
                f"mean wait in the engine's queue {_s(e.queue_wait.mean)} s"
                for group, e in a.engines.items()
            )
        )
    else:
        lines.append("engines: not scraped (add --engine-url for the VEs and PDs)")
    lines += [f"note: {n}" for n in a.notes]
    lines += ["", f"verdict: {a.verdict()}", f"confidence: {a.confidence()}"]
    return lines


def recommendation_lines(rec: Recommendation | None) -> list[str]:
    if rec is None:
        return ["recommendation: none (the window does not support one)"]
    b, f = rec.before, rec.after
    model = (
        f"VE busy {_pct(b.ve.utilisation)} -> {_pct(f.ve.utilisation)}, PD busy {_pct(b.pd.utilisation)} -> "
        f"{_pct(f.pd.utilisation)}; queueing in front of VE {_s(b.ve.queueing_s)} -> {_s(f.ve.queueing_s)} s, "
        f"PD {_s(b.pd.queueing_s)} -> {_s(f.pd.queueing_s)} s; TTFT mean {_s(rec.measured_ttft_s)} -> "
        f"{_s(rec.predicted_ttft_s)} s; VE+PD mean time per request {_s(b.mean_s)} -> {_s(f.mean_s)} s; "
        f"most requests/s at this mix {b.max_rate:.1f} -> {f.max_rate:.1f}"
    )
    refused = [] if rec.refused is None else [f"not proposed: {rec.refused}"]
    if not rec.changed:
        return [
            f"recommendation: {'add a host' if rec.needs_hosts else 'no change'} ({rec.reason})",
            *refused,
            f"model (M/M/c per pool, docs/advisor.md): VE busy {_pct(b.ve.utilisation)}, PD busy "
            f"{_pct(b.pd.utilisation)}; most requests/s at this mix {b.max_rate:.1f}",
            *headroom_lines(rec),
        ]
    lines = [f"recommendation: change the layout, {rec.reason} (the planner accepts it; the rollout floors hold)"]
    lines += refused
    lines.append(f"predicted at the same load (M/M/c per pool, docs/advisor.md): {model}")
    lines += headroom_lines(rec)
    lines += ["", "inventory change (host_vars or the host's line in the inventory):"]
    lines += [f"  {line}" for line in rec.inventory_change()]
    lines += ["", "plan of the new layout:"] + [f"  {line}" for line in rec.plan_lines]
    lines += [
        "",
        "apply: edit the inventory, then `ansible-playbook -i <inventory> playbooks/deploy.yml`; the rolling "
        "change restarts only the engines whose slice or port moved and drains removed ones. The advisor "
        "changed nothing.",
    ]
    return lines


def headroom_lines(rec: Recommendation) -> list[str]:
    """How far the load can grow on the layout, and what to change past that."""
    f = rec.after
    targets = f"{rec.target:.0%} busy or {rec.target_queueing:.0%} of its time queueing"
    layout = "the proposed layout" if rec.changed else "this layout"
    if math.isinf(rec.headroom):
        return [f"headroom: {layout} has no busy pool at this load"]
    if rec.headroom < 1:
        return [
            f"headroom: none; {layout}'s busiest pool, {f.busiest_role.upper()}, stays {_pct(f.busiest)} busy "
            f"({_pct(f.most_queueing)} of a pool's time queueing), past the targets ({targets}): the load needs "
            "more hosts"
        ]
    lines = [
        f"headroom: {layout}'s busiest pool, {f.busiest_role.upper()}, is {_pct(f.busiest)} busy: the load can "
        f"grow {rec.headroom:.2f}x (to {f.pd.rate * rec.headroom:.1f} requests/s) before a pool passes {targets}"
    ]
    step = rec.next_step
    if step is None:
        return lines
    if step.layout is None or step.prediction is None:
        return [*lines, "next step, past that load: none on these hosts (another host)"]
    change = "; ".join(step.layout.inventory_change(rec.proposed))
    p = step.prediction
    return [
        *lines,
        f"next step, past that load: {change} (at {step.load:.2f}x: VE busy {_pct(p.ve.utilisation)}, "
        f"PD busy {_pct(p.pd.utilisation)})",
    ]
