"""Markdown tables for docs/benchmarks.md from bench/results/*.json.

    python -m bench.report [--results DIR]
        [--section router_overhead|preprocess|ve_placement|pd_placement|pd_placement_sim]

Every block starts with the command, the date and the machine the numbers came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS_DIR

SECTIONS = ("router_overhead", "preprocess", "ve_placement", "pd_placement", "pd_placement_sim")


def provenance(rec: dict) -> str:
    m = rec["machine"]
    load = ", ".join(f"{x:.1f}" for x in m["loadavg_at_start"])
    end = rec.get("loadavg_at_end")
    if end:
        load += f" (1-min load {end[0]:.1f} at the end)"
    return (
        f"Command: `{rec['command']}` · run {rec['started_utc']} at {rec.get('revision') or '?'} · "
        f"{rec['wall_s']:.0f} s wall · "
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), Python {m['python']}, "
        f"load average at start {load}, {m['other_processes_busy']} other runnable processes · single run"
    )


def f(x, nd=1) -> str:
    if x is None:
        return "–"
    return f"{x:.{nd}f}"


def router_overhead(rec: dict) -> str:
    r = rec["results"]
    out = [provenance(rec), ""]
    for kind, cells in r["cells"].items():
        out += [
            f"**{kind}**",
            "",
            "| conc. | direct p50 / p99 ms | floor added p50 / p99 ms | router added p50 / p99 ms "
            "| router ÷ floor (p50 added) | req/s direct / floor / router | CPU ms per 1k req floor / router "
            "| peak RSS MiB floor / router |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c, row in cells.items():
            d, fl, ro, add = row["direct"], row["floor"], row["router"], row["added"]
            out.append(
                f"| {c} | {f(d['p50_ms'], 2)} / {f(d['p99_ms'], 2)} "
                f"| {f(add['floor']['p50_ms'], 2)} / {f(add['floor']['p99_ms'], 2)} "
                f"| {f(add['router']['p50_ms'], 2)} / {f(add['router']['p99_ms'], 2)} "
                f"| {f(row['router_over_floor_p50'], 2)}× "
                f"| {f(d['rps'], 0)} / {f(fl['rps'], 0)} / {f(ro['rps'], 0)} "
                f"| {f(fl['proxy_cpu_ms_per_1k'], 0)} / {f(ro['proxy_cpu_ms_per_1k'], 0)} "
                f"| {f(fl['proxy_peak_rss_mib'], 0)} / {f(ro['proxy_peak_rss_mib'], 0)} |"
            )
        errs = sum(row[c2]["errors"] for row in cells.values() for c2 in ("direct", "floor", "router"))
        note = (
            " Above concurrency 1 the single sim VE (one request at a time, 8 MB JSON per "
            "request, on the load generator's CPU) is the bottleneck: added latency there is "
            "queueing at the VE, not router work."
            if kind != "text"
            else ""
        )
        out += [
            "",
            f"Errors in this kind: {errs}.{note} Requests per level: "
            + ", ".join(
                f"c={c}: {row['direct']['n']} / {row['floor']['n']} / {row['router']['n']}" for c, row in cells.items()
            )
            + " (direct / floor / router).",
            "",
        ]
    prof = r.get("profile") or {}
    for kind, p in prof.items():
        if not p or "share_of_busy" not in p:
            out.append(f"Profile {kind}: {p}")
            continue
        out += [
            f"**Where epd-router's CPU goes, {kind}, concurrency 16** (py-spy, every thread, "
            f"{p['busy_samples']} busy samples):",
            "",
            "| bucket | share of busy samples |",
            "|---|---|",
        ]
        out += [f"| {k} | {100 * v:.0f}% |" for k, v in p["share_of_busy"].items() if v >= 0.005]
        out += ["", "Top leaf frames: " + "; ".join(f"`{k}` {100 * v:.0f}%" for k, v in p["top_leaves"][:6]), ""]
    return "\n".join(out)


def preprocess(rec: dict) -> str:
    r = rec["results"]
    out = [
        provenance(rec),
        "",
        "| image | grid | path | cold images/CPU-s | warm images/CPU-s |",
        "|---|---|---|---|---|",
    ]
    for size, s in r["sizes"].items():
        grid = "×".join(map(str, s["grid_thw"]))
        out.append(
            f"| {size} JPEG ({s['jpeg_bytes_mean'] / 1024:.0f} kB) | {grid} | transformers | "
            f"{s['cold_plain']['images_per_core_s']:.1f} | {s['warm_plain']['images_per_core_s']:.1f} |"
        )
        out.append(
            f"| | | router | {s['cold_ours']['images_per_core_s']:.1f} | {s['warm_ours']['images_per_core_s']:.0f} |"
        )
        out.append(f"| | | **router ÷ transformers** | **{s['cold_speedup']:.2f}×** | **{s['warm_speedup']:.0f}×** |")
    out += [
        "",
        "Images measured (cold per path / warm router): "
        + "; ".join(
            f"{size}: {s['cold_ours']['images']} / {s['warm_ours']['images']}" for size, s in r["sizes"].items()
        )
        + f". Wire bytes (VE and PD kwargs) asserted identical on "
        f"{next(iter(r['sizes'].values()))['wire_identical_images_checked']} images per size.",
        "",
    ]
    return "\n".join(out)


def ve_placement(rec: dict) -> str:
    r = rec["results"]
    p = r["params"]
    out = [
        provenance(rec),
        "",
        f"{p['n_requests']} requests per Zipf value, {p['catalogue']} distinct images, 1–4 images "
        f"per request, {p['n_ve']} VEs × {p['cache_items']}-item LRU, offered load "
        f"{p['target_utilisation']:.0%} of VE capacity at the ceiling's hit rate, encode "
        f"{p['encode_s_per_token'] * 256 * 1e3:.0f} ms for a 512×512 image (256 tokens; images of "
        f"64/176/256 tokens), hit "
        f"{p['hit_s'] * 1e3:.0f} ms, {p['post_s'] * 1e3:.0f} ms per POST.",
        "",
    ]
    for z, res in r["by_zipf"].items():
        out += [
            f"**Zipf s = {z}**: ceiling (one shared LRU of {p['n_ve'] * p['cache_items']} items) hit "
            f"rate {res['ceiling_hit_rate']:.3f}, {res['offered_rate_per_s']:.0f} requests/s offered",
            "",
            "| policy | hit rate | % of ceiling | max/mean items per VE | max/mean encoder busy time "
            "| encode wait p50 / p99 ms | items off their HRW VE |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, pr in res["policies"].items():
            out.append(
                f"| {name} | {pr['hit_rate']:.3f} | {100 * pr['hit_rate_vs_ceiling']:.1f}% "
                f"| {pr['max_mean_items']:.2f} | {pr['max_mean_busy']:.2f} "
                f"| {pr['encode_wait_p50_ms']:.0f} / {pr['encode_wait_p99_ms']:.0f} "
                f"| {100 * pr['spill_fraction']:.0f}% |"
            )
        out.append("")
    return "\n".join(out)


def _pd_rows(policies: dict) -> list[str]:
    rows = [
        "| policy | TTFT p50 ms | TTFT p99 ms | end-to-end p99 ms | throughput req/s | tokens/s "
        "| requests per PD (max/mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, pr in policies.items():
        spread = pr.get("per_pd_requests")
        if spread and len(spread) > 1:
            spread_s = f"{spread} ({max(spread) / (sum(spread) / len(spread)):.2f})"
        elif spread:
            spread_s = "(inside the router)"
        else:
            spread_s = f"{pr['max_mean_requests']:.2f}"
        rows.append(
            f"| {name} | {pr['ttft_p50_ms']:.0f} | {pr['ttft_p99_ms']:.0f} | {pr['e2e_p99_ms']:.0f} "
            f"| {pr['throughput_rps']:.1f} | {pr['tokens_per_s']:.0f} | {spread_s} |"
        )
    return rows


def pd_placement(rec: dict) -> str:
    r = rec["results"]
    p = r["params"]
    out = [
        provenance(rec),
        "",
        f"{p['n_pd']} sim PDs, max-num-seqs {p['max_num_seqs']}, decode step "
        f"{p['decode_ms_per_token']} ms, prefill {p['prefill_ms_per_1k_tokens']} ms per 1k tokens "
        f"({p['prompt_tokens']}-token prompt), outputs log-uniform {p['min_tokens']}–{p['max_tokens']} tokens; "
        f"capacity {r['capacity_rps']:.1f} req/s, offered {r['offered_rate_per_s']:.1f} req/s "
        f"({p['utilisation']:.0%}); {p['n_requests']} requests per policy.",
        "",
        "Real HTTP:",
        "",
    ]
    out += _pd_rows(r["http"]["policies"])
    h = r["http"]["policies"]
    out += [
        "",
        f"p99 TTFT reduction: **{100 * r['http']['p99_ttft_reduction']:.0f}%** (p50: "
        f"{100 * r['http']['p50_ttft_reduction']:.0f}%). Errors: "
        f"{sum(x['errors'] for x in h.values())}; observed decode ms/token p50: "
        + ", ".join(f"{x['tpot_p50_ms']:.1f}" for x in h.values())
        + "; max dispatch lag: "
        + ", ".join(f"{x['max_dispatch_lag_ms']:.0f} ms" for x in h.values())
        + "".join(
            f"; epd-router CPU {x['router_cpu_ms_per_1k_tokens']:.0f} ms per 1,000 streamed tokens"
            for x in h.values()
            if x.get("router_cpu_ms_per_1k_tokens")
        ),
        "",
    ]
    if "des" in r:
        d = r["des"]
        out += [f"Discrete-event companion, same model and load, {d['params']['n_requests']} requests:", ""]
        out += _pd_rows(d["policies"])
        out += ["", f"p99 TTFT reduction: **{100 * d['p99_ttft_reduction']:.0f}%**", ""]
    return "\n".join(out)


def pd_placement_sim(rec: dict) -> str:
    out = [
        provenance(rec),
        "",
        "| offered load | p99 TTFT round-robin ms | p99 TTFT least-outstanding ms | reduction |",
        "|---|---|---|---|",
    ]
    for u, res in rec["results"].items():
        rr, lo = res["policies"].values()
        out.append(
            f"| {float(u):.0%} ({res['offered_rate_per_s']:.0f} req/s) | {rr['ttft_p99_ms']:.0f} "
            f"| {lo['ttft_p99_ms']:.0f} | {100 * res['p99_ttft_reduction']:.0f}% |"
        )
    return "\n".join(out + [""])


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def summary(results: Path) -> str:
    """The goal table rows: goal, measured result, met or by how much not."""
    rows = []
    ro = _load(results, "router_overhead")
    if ro:
        text = ro["results"]["cells"].get("text", {})
        ratios = {c: row["router_over_floor_p50"] for c, row in text.items()}
        met = [c for c, r in ratios.items() if r is not None and r <= 1.5]
        res = ", ".join(f"c={c}: {f(r, 2)}×" for c, r in ratios.items())
        verdict = "yes" if len(met) == len(ratios) else (f"at c={', '.join(met)} only" if met else "no")
        rows.append(f"| 1 | router overhead, text | p50 added latency ≤ 1.5× the floor's | {res} | {verdict} |")
    pp = _load(results, "preprocess")
    if pp:
        sz = pp["results"]["sizes"]
        warm = ", ".join(f"{k}: {v['warm_speedup']:.0f}×" for k, v in sz.items())
        cold = ", ".join(f"{k}: {v['cold_speedup']:.2f}×" for k, v in sz.items())
        ok = all(v["warm_speedup"] >= 2 and v["cold_speedup"] >= 1 for v in sz.values())
        rows.append(
            f"| 2 | image preprocessing | ≥ 2× warm, no slower cold, identical wire bytes "
            f"| warm {warm}; cold {cold}; bytes identical | {'yes' if ok else 'no'} |"
        )
    ve = _load(results, "ve_placement")
    if ve:
        parts, oks = [], []
        for z, res in ve["results"]["by_zipf"].items():
            ours = next(v for k, v in res["policies"].items() if k.startswith("ours"))
            parts.append(
                f"s={z}: {100 * ours['hit_rate_vs_ceiling']:.0f}% of ceiling, max/mean "
                f"{ours['max_mean_items']:.2f} items / {ours['max_mean_busy']:.2f} busy"
            )
            oks.append(ours["hit_rate_vs_ceiling"] >= 0.95 and ours["max_mean_items"] <= 1.25)
        verdict = "yes" if all(oks) else "balance yes, hit rate no" if not any(oks) else "partly"
        rows.append(
            f"| 3 | VE placement (DES) | ours ≥ 95% of ceiling hit rate, max/mean ≤ 1.25 "
            f"| {'; '.join(parts)} | {verdict} |"
        )
    pd = _load(results, "pd_placement")
    if pd:
        h = pd["results"]["http"]["p99_ttft_reduction"]
        d = pd["results"].get("des", {}).get("p99_ttft_reduction")
        rows.append(
            f"| 4 | PD placement | p99 TTFT ≥ 30% lower than round-robin | real HTTP {100 * h:.0f}% lower"
            + (f"; DES {100 * d:.0f}% lower" if d is not None else "")
            + f" | {'yes' if h >= 0.3 else 'no'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    ap.add_argument("--section", choices=SECTIONS, nargs="*", default=list(SECTIONS))
    ap.add_argument("--summary", action="store_true", help="only the goal table rows")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(args.results))
        return
    for name in args.section:
        path = args.results / f"{name}.json"
        if not path.exists():
            print(f"## {name}: no results ({path} missing; run bench/run.sh)\n")
            continue
        print(f"## {name}\n")
        print(globals()[name](json.loads(path.read_text())))


if __name__ == "__main__":
    main()
