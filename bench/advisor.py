"""The advisor's image-heavy case, measured before and after its recommendation (docs/advisor.md).

What runs: sim engines with the kit's exact argv (bench/stack.py) and epd-router on 127.0.0.1.
Layout A is the sandbox's one host (24 cores: 1 VE + 2 PD). An open-loop Poisson load of
chat requests, each with a new 256x256 JPEG (a VE cache miss every time), runs for a bounded
window; the router's /metrics is saved before and after it; `epd_kit.advise` reads the two
scrapes against a one-host inventory and recommends a layout; the same load (same arrivals,
same images) then runs on that layout. Client-side p50/p99 latency, throughput and failures
of both runs, the advisor's figures and prediction go to bench/results/advisor.json, the
picture to docs/img/advisor-before-after.svg, the scrapes and the advisor's report beside the JSON.

    .venv/bin/python -m bench.advisor [--rate 10] [--seconds 40]

Bounded: at most rate x seconds requests per layout, each with a 30 s timeout; 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from bench.common import IMG_DIR, RESULTS_DIR, git_revision, percentile
from bench.images import data_url, jpeg, jpeg_variant
from bench.stack import engine_proc, router_proc
from epd_kit.advise.analysis import Analysis, analyse
from epd_kit.advise.layout import Advisor, Recommendation, inventory_from_json
from epd_kit.advise.report import analysis_lines, recommendation_lines
from epd_kit.advise.scrape import parse_text
from epd_kit.advise.window import Window

HOST, CORES = "n1", 24  # inventory/sandbox/one-host: PD tp8 at 0 and 8, VE tp4 at 16
REQUEST_TIMEOUT_S = 30.0


def sim_flags(encode_ms_per_1k: float) -> list[str]:
    # a VE cost that makes one VE the bottleneck at the offered rate; PD work stays small
    return [
        "--sim-profile",
        "zero",
        "--sim-encode-ms-per-1k-patches",
        str(encode_ms_per_1k),
        "--sim-prefill-ms-per-1k-tokens",
        "50",
        "--sim-decode-ms-per-token",
        "5",
    ]


def inventory(num_ve: int, num_pd: int) -> dict:
    """`ansible-inventory --list` of the sandbox's one host with these counts."""
    variables = {
        "epd_model": "/models/tiny-qwen3-vl",
        "epd_engine_backend": "sim",
        "epd_core_count": CORES,
        "epd_num_ve": num_ve,
        "epd_num_pd": num_pd,
    }
    return {
        "_meta": {"hostvars": {HOST: variables}},
        "all": {"children": ["epd_engines", "epd_router"]},
        "epd_engines": {"hosts": [HOST]},
        "epd_router": {"hosts": [HOST]},
    }


def body(index: int, image: bytes) -> bytes:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(jpeg_variant(image, index))}},
        {"type": "text", "text": f"Request {index}: describe the image."},
    ]
    return json.dumps({"model": "bench", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}).encode()


async def drive(url: str, arrivals: np.ndarray, image: bytes, first: int) -> dict:
    """Open-loop load: request i at arrivals[i]; latencies of the 200s, the rest counted."""
    latencies: list[float] = []
    failed = 0
    bodies = [body(first + i, image) for i in range(len(arrivals))]
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter() + 0.2

        async def one(i: int) -> None:
            nonlocal failed
            await asyncio.sleep(max(0.0, t0 + float(arrivals[i]) - time.perf_counter()))
            start = time.perf_counter()
            try:
                async with session.post(url + "/v1/chat/completions", data=bodies[i]) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                failed += 1

        await asyncio.gather(*(one(i) for i in range(len(arrivals))))
        elapsed = time.perf_counter() - t0
    return {
        "requests": len(arrivals),
        "ok": len(latencies),
        "failed": failed,
        "throughput_per_s": len(latencies) / elapsed,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "mean_s": sum(latencies) / max(1, len(latencies)),
    }


def run_layout(num_ve: int, num_pd: int, args, arrivals: np.ndarray, work: Path, ckpt: Path) -> dict:
    flags = sim_flags(args.encode_ms_per_1k)
    engines = [engine_proc("ve", i, ckpt, work, sim_flags=flags) for i in range(num_ve)]
    engines += [engine_proc("pd", i, ckpt, work, sim_flags=flags) for i in range(num_pd)]
    procs = [p.start() for p in engines]
    try:
        for p in procs:
            p.wait_healthy()
        router = router_proc(ckpt, procs[:num_ve], procs[num_ve:], work).start()
        procs.append(router)
        router.wait_healthy()
        image = jpeg(0, 256, 256)
        asyncio.run(drive(router.url, np.arange(10) * 0.1, image, first=10_000_000))  # warm-up
        before = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
        started = time.monotonic()
        client = asyncio.run(drive(router.url, arrivals, image, first=0))
        after = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
        seconds = time.monotonic() - started
    finally:
        for p in reversed(procs):
            p.stop()
    return {"layout": [num_ve, num_pd], "client": client, "before": before, "after": after, "seconds": seconds}


def advise(run: dict) -> tuple[Analysis, Recommendation | None]:
    advisor = Advisor(inventory_from_json(inventory(*run["layout"]), "bench"))
    window = Window(parse_text(run["before"], "before"), parse_text(run["after"], "after"), run["seconds"])
    analysis = analyse(window, advisor.pd_slots)
    return analysis, advisor.recommend(analysis)


def figures(analysis) -> dict:
    return {
        "stages_s": {
            "preprocess": analysis.stages.preprocess_s,
            "encode": analysis.stages.encode_s,
            "pd_first_token": analysis.stages.pd_first_token_s,
        },
        "busy": {role: pool.busy for role, pool in analysis.pools.items()},
        "ttft_p50_s": analysis.ttft.quantile(0.5),
        "ttft_p99_s": analysis.ttft.quantile(0.99),
        "verdict": analysis.verdict(),
    }


def svg(before: dict, after: dict, labels: tuple[str, str], path: Path) -> None:
    """Two panels, drawn by hand (no plotting library in the venv): mean seconds per stage of a
    request, and each pool's busy fraction, before and after."""
    colours = {"preprocess": "#9e9e9e", "encode": "#e4572e", "pd_first_token": "#4c72b0"}
    width, height = 720, 300
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="20" y="22" font-size="14">Mean time to first token by stage (s)</text>',
        '<text x="400" y="22" font-size="14">Pool busy fraction</text>',
    ]
    top = max(sum(f["stages_s"].values()) for f in (before, after)) or 1.0
    for column, (label, fig) in enumerate(zip(labels, (before, after), strict=True)):
        x, y = 60 + column * 140, 260
        for stage, value in fig["stages_s"].items():
            h = 200 * value / top
            y -= h
            out.append(f'<rect x="{x}" y="{y:.1f}" width="80" height="{h:.1f}" fill="{colours[stage]}"/>')
        out.append(f'<text x="{x}" y="280">{label}</text>')
        out.append(f'<text x="{x}" y="{y - 4:.1f}">{sum(fig["stages_s"].values()):.3f} s</text>')
        for row, role in enumerate(("ve", "pd")):
            bx, by = 400 + column * 150, 60 + row * 100
            busy = min(1.0, fig["busy"][role])
            out.append(f'<rect x="{bx}" y="{by}" width="120" height="24" fill="none" stroke="#333"/>')
            out.append(f'<rect x="{bx}" y="{by}" width="{120 * busy:.1f}" height="24" fill="#55a868"/>')
            out.append(f'<text x="{bx}" y="{by - 4}">{role.upper()} {label}: {fig["busy"][role]:.0%}</text>')
    for row, (stage, colour) in enumerate(colours.items()):
        out.append(f'<rect x="400" y="{250 + row * 16}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="416" y="{259 + row * 16}">{stage.replace("_", " ")}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s offered")
    parser.add_argument("--seconds", type=float, default=40.0, help="load window per layout (at most 120)")
    parser.add_argument("--encode-ms-per-1k", type=float, default=300.0, help="sim VE cost per 1024 patches")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.seconds = min(args.seconds, 120.0)
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="epd-bench-advisor-"))
    ckpt = build_tiny_checkpoint(work / "checkpoint")
    rng = np.random.default_rng(args.seed)
    count = int(args.rate * args.seconds)
    arrivals = np.cumsum(rng.exponential(1 / args.rate, size=count))

    first = run_layout(1, 2, args, arrivals, work / "a", ckpt)
    analysis, rec = advise(first)
    if rec is None or not rec.changed:
        print("\n".join(analysis.notes + [analysis.verdict(), analysis.confidence()]))
        print("the advisor recommended no change: nothing to compare")
        return 1
    proposed = rec.proposed.counts[HOST]
    second = run_layout(*proposed, args, arrivals, work / "b", ckpt)
    after_analysis, _ = advise(second)
    before_fig, after_fig = figures(analysis), figures(after_analysis)
    labels = (f"{first['layout'][0]}E{first['layout'][1]}PD", f"{proposed[0]}E{proposed[1]}PD")
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    svg(before_fig, after_fig, labels, IMG_DIR / "advisor-before-after.svg")
    result = {
        "revision": git_revision(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(args),
        "inventory_change": rec.inventory_change(),
        "predicted": {
            "busy_before": {"ve": rec.before.ve.utilisation, "pd": rec.before.pd.utilisation},
            "busy_after": {"ve": rec.after.ve.utilisation, "pd": rec.after.pd.utilisation},
            "mean_s_before": rec.before.mean_s,
            "mean_s_after": rec.after.mean_s,
        },
        "before": {"layout": labels[0], "client": first["client"], "router": before_fig},
        "after": {"layout": labels[1], "client": second["client"], "router": after_fig},
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name, run in (("a", first), ("b", second)):  # `epd-router advise --before/--after` reads these
        (RESULTS_DIR / f"advisor-{name}-before.prom").write_text(run["before"])
        (RESULTS_DIR / f"advisor-{name}-after.prom").write_text(run["after"])
    (RESULTS_DIR / "advisor-inventory.json").write_text(json.dumps(inventory(*first["layout"])))
    report = "\n".join(analysis_lines(analysis) + [""] + recommendation_lines(rec))
    (RESULTS_DIR / "advisor-report.txt").write_text(report + "\n")
    (RESULTS_DIR / "advisor.json").write_text(json.dumps(result, indent=2))
    print(report)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
