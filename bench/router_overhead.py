"""Section 1: router overhead against a direct call and a minimal two-hop proxy (the floor).

The same logical requests go three ways, in one run, interleaved cell by cell:
  direct  the load generator calls the sim VE (image requests) then the sim PD itself, with
          bodies rendered beforehand by the router's own Preprocessor (zero sim latency);
  floor   bench.passthrough_proxy: the same engine hops, nothing else (httpx + uvicorn);
  router  epd-router with a router.yaml like the one Ansible renders, OpenAI chat requests.
Request kinds: text-only; one 512x512 JPEG repeated (the router's cache and the VE's encoder
cache hit); one distinct 512x512 JPEG per request (same pixels, a different JPEG comment, so
every request is a cache miss and the router preprocesses it in full).
Added latency = percentile(proxy) - percentile(direct) at the same concurrency.
Router/floor CPU per 1,000 requests from /proc/<pid>/stat (all threads), peak RSS = VmHWM
(reset through /proc/<pid>/clear_refs before each cell). Optional py-spy profile of the
router (all threads) for the text and the distinct-image cases.

Two optional routers join the rotation as paths of their own, measured like `router`:
  before  (--baseline REF) the router of git REF (its tree from `git archive`, run from this
          venv with PYTHONPATH on it): a change's cost, before and after side by side in one run;
  traced  (--traced) this checkout's router with tracing on (router.yaml tracing), exporting
          every request's spans to an OTLP/HTTP receiver in this process (epd_kit.testing.otlp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import images
from bench.common import IMG_DIR, REPO, RESULTS_DIR, RunRecord, percentile
from bench.httpload import Connection, Target, closed_loop, encode_post
from bench.procs import VENV_BIN, Proc, pin_self
from bench.stack import engine_proc, floor_proc, router_proc
from epd_kit import wire

PROMPT = "Describe the picture in one short sentence, then list three colours you see in it."
MAX_TOKENS = 16
KINDS = ("text", "image-repeated", "image-distinct")
CONFIGS = ("direct", "floor", "router")
ROUTERS = ("router", "before", "traced")  # paths that send OpenAI requests to a router
EC_TRANSFER_TIMEOUT_S = 30.0


def jpeg_variant(jpeg: bytes, n: int) -> bytes:
    """Same pixels, different bytes: a COM segment right after SOI carries `n`."""
    comment = f"bench-{n}".encode()
    segment = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
    return jpeg[:2] + segment + jpeg[2:]


def chat_body(url: str | None) -> bytes:
    content: list | str = PROMPT
    if url is not None:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    return json.dumps(
        {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS}
    ).encode()


@dataclass
class Bodies:
    """Pre-encoded engine bodies for one request kind (direct and floor paths)."""

    pd_prefix: bytes  # PD body up to the ec_locator value
    pd_suffix: bytes
    pd_plain: bytes  # PD body without locators (floor input; text: the whole PD body)
    ve_parts: list[bytes] | None  # VE body split at its mm_hash (None for text)
    pd_plain_parts: list[bytes] | None
    prefix_parts: list[bytes] | None
    mm_hash: str | None


SENTINEL = "__EC_LOCATOR__"


def render_bodies(checkpoint: Path, url: str | None) -> Bodies:
    from epd_kit.preprocess.preprocessor import Preprocessor

    pre = Preprocessor.from_checkpoint(checkpoint, workers=1)
    content: list | str = PROMPT
    if url is not None:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    rendered = asyncio.run(pre.render([{"role": "user", "content": content}]))
    sp = wire.SamplingParams(max_tokens=MAX_TOKENS)
    pd_req = wire.GenerateRequest(
        request_id="bench", token_ids=rendered.token_ids, features=rendered.pd_features(), sampling_params=sp
    )
    pd_plain = json.dumps(pd_req.wire_dict()).encode()
    with_loc = pd_req.wire_dict()
    with_loc["sampling_params"]["extra_args"] = {"kv_transfer_params": {"ec_locator": SENTINEL}}
    prefix, suffix = json.dumps(with_loc).encode().split(json.dumps(SENTINEL).encode())
    if not rendered.items:
        return Bodies(prefix, suffix, pd_plain, None, None, None, None)
    item = rendered.items[0]
    ve_req = wire.GenerateRequest(
        request_id="bench/enc",
        token_ids=[0] * item.length,
        features=wire.Features.of_images(
            [item.mm_hash], [wire.Placeholder(offset=0, length=item.length)], [item.ve_kwargs_b64]
        ),
        sampling_params=wire.SamplingParams(max_tokens=1),
    )
    ve_body = json.dumps(ve_req.wire_dict()).encode()
    h = item.mm_hash.encode()
    return Bodies(prefix, suffix, pd_plain, ve_body.split(h), pd_plain.split(h), prefix.split(h), item.mm_hash)


class Workload:
    """Scenarios for one kind; a process-wide counter makes distinct requests distinct
    everywhere (also across Workload objects: the profile pass must not hit the router's
    cache with images the measured pass already sent)."""

    _serial = itertools.count(1)

    def __init__(self, kind: str, checkpoint: Path) -> None:
        self.kind = kind
        base = images.jpeg(7, 512, 512) if kind != "text" else None
        self.base_jpeg = base
        self.bodies = render_bodies(checkpoint, images.data_url(base) if base else None)
        self.router_same = chat_body(images.data_url(base) if base else None)

    def _hash(self) -> bytes:
        if self.kind != "image-distinct":
            return self.bodies.mm_hash.encode()
        return f"{next(self._serial):064x}".encode()

    def router_body(self) -> bytes:
        if self.kind != "image-distinct":
            return self.router_same
        return chat_body(images.data_url(jpeg_variant(self.base_jpeg, next(self._serial))))

    def scenario(self, config: str, ports: dict[str, int]):
        b = self.bodies
        ok_marker = b'"choices"'

        async def direct(conns: dict[str, Connection], idx: int) -> tuple[bool, float]:
            if b.ve_parts is None:
                r = await conns["pd"].request(encode_post(wire.GENERATE_PATH, b.pd_plain, ports["pd"]))
                return r.status == 200 and ok_marker in r.body, r.first_byte_s
            h = self._hash()
            ve = await conns["ve"].request(encode_post(wire.GENERATE_PATH, h.join(b.ve_parts), ports["ve"]))
            if ve.status != 200:
                return False, 0.0
            loc = json.dumps(json.loads(ve.body)["kv_transfer_params"]["ec_locator"]).encode()
            body = h.join(b.prefix_parts) + loc + b.pd_suffix
            r = await conns["pd"].request(encode_post(wire.GENERATE_PATH, body, ports["pd"]))
            return r.status == 200 and ok_marker in r.body, r.first_byte_s

        async def floor(conns: dict[str, Connection], idx: int) -> tuple[bool, float]:
            if b.ve_parts is None:
                r = await conns["floor"].request(encode_post("/text", b.pd_plain, ports["floor"]))
            else:
                h = self._hash()
                ve_body = h.join(b.ve_parts)
                r = await conns["floor"].request(
                    encode_post(
                        "/image", ve_body + h.join(b.pd_plain_parts), ports["floor"], {"x-ve-length": str(len(ve_body))}
                    )
                )
            return r.status == 200 and ok_marker in r.body, r.first_byte_s

        async def router(conns: dict[str, Connection], idx: int) -> tuple[bool, float]:
            r = await conns["router"].request(encode_post("/v1/chat/completions", self.router_body(), ports["router"]))
            return r.status == 200 and ok_marker in r.body, r.first_byte_s

        async def other_router(conns: dict[str, Connection], idx: int) -> tuple[bool, float]:
            r = await conns[config].request(encode_post("/v1/chat/completions", self.router_body(), ports[config]))
            return r.status == 200 and ok_marker in r.body, r.first_byte_s

        return {"direct": direct, "floor": floor, "router": router}.get(config, other_router)


@dataclass
class Cell:
    n: int
    errors: int
    error_examples: list[str]
    p50_ms: float
    p99_ms: float
    mean_ms: float
    rps: float
    proxy_cpu_ms_per_1k: float | None
    proxy_peak_rss_mib: float | None
    wall_s: float


def run_row(
    wl: Workload,
    ports: dict[str, int],
    proxies: dict[str, Proc],
    concurrency: int,
    max_requests: int,
    deadline_s: float,
    rounds: int,
    configs: Sequence[str] = CONFIGS,
) -> dict[str, Cell]:
    """One concurrency level, every path, interleaved: `rounds` rounds of direct, floor,
    router (and `before`, `traced`), each 1/rounds of the count and time budget, so that
    background load on this shared machine falls on all alike. Samples, CPU and wall time are
    pooled."""
    warm = min(concurrency, 8)
    acc = {
        cfg: {"lat": [], "n": 0, "err": 0, "ex": [], "ok": 0, "wall": 0.0, "cpu": 0.0, "sent": 0, "rss": 0.0}
        for cfg in configs
    }
    for cfg in configs:
        if cfg in proxies:
            proxies[cfg].reset_peak_rss()
    for _ in range(rounds):
        for cfg in configs:
            targets = {"direct": ("ve", "pd")}.get(cfg, (cfg,))
            tgt = {name: Target("127.0.0.1", ports[name]) for name in targets}
            proxy = proxies.get(cfg)
            cpu0 = proxy.cpu_s() if proxy else 0.0
            res = asyncio.run(
                closed_loop(
                    tgt,
                    wl.scenario(cfg, ports),
                    concurrency=concurrency,
                    max_requests=max(1, max_requests // rounds),
                    deadline_s=deadline_s / rounds,
                    warmup=warm,
                )
            )
            a = acc[cfg]
            a["lat"] += [x * 1e3 for x in res.ok_latencies]
            a["n"] += len(res.samples)
            a["ok"] += sum(s.ok for s in res.samples)
            a["err"] += sum(not s.ok for s in res.samples)
            a["ex"] += res.errors
            a["wall"] += res.wall_s
            a["sent"] += len(res.samples) + warm  # warmup requests cost CPU too
            if proxy:
                a["cpu"] += proxy.cpu_s() - cpu0
    out = {}
    for cfg, a in acc.items():
        proxy = proxies.get(cfg)
        lat = a["lat"]
        out[cfg] = Cell(
            n=a["n"],
            errors=a["err"],
            error_examples=a["ex"][:3],
            p50_ms=percentile(lat, 50),
            p99_ms=percentile(lat, 99),
            mean_ms=sum(lat) / len(lat) if lat else float("nan"),
            rps=a["ok"] / a["wall"] if a["wall"] else 0.0,
            proxy_cpu_ms_per_1k=a["cpu"] * 1e3 / a["sent"] * 1000 if proxy else None,
            proxy_peak_rss_mib=proxy.peak_rss_mib() if proxy else None,
            wall_s=a["wall"],
        )
    return out


def profile_router(
    router: Proc, wl: Workload, ports: dict[str, int], concurrency: int, max_requests: int, deadline_s: float, out: Path
) -> dict | None:
    """py-spy (every thread, native off) on the router while a bounded load runs."""
    spy = shutil.which("py-spy", path=str(VENV_BIN)) or shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy not installed (pip install py-spy)"}
    raw = out.with_suffix(".txt")
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "-p",
            str(router.pid),
            "-r",
            "200",
            "-f",
            "raw",
            "-o",
            str(raw),
            "-d",
            str(int(deadline_s) + 2),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)
    tgt = {"router": Target("127.0.0.1", ports["router"])}
    asyncio.run(
        closed_loop(
            tgt, wl.scenario("router", ports), concurrency=concurrency, max_requests=max_requests, deadline_s=deadline_s
        )
    )
    try:
        proc.wait(timeout=deadline_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"skipped": "py-spy did not finish"}
    if not raw.exists():
        return {"skipped": f"py-spy failed: {proc.stderr.read().decode()[-300:] if proc.stderr else ''}"}
    return summarize_stacks(raw.read_text())


# A sample is idle when its leaf frame is a wait: the event loop in epoll, a pool worker
# blocked on its work queue (py-spy reports those threads as active: the wait is in C).
IDLE_LEAVES = ("select (selectors.py", "_worker (concurrent/futures/thread.py", "wait (threading.py")
# A busy sample is charged to the innermost frame (leaf upward) that matches one of these.
BUCKETS = (
    ("pixel_values (", "preprocess: pixel_values (numpy)"),
    ("PixelEncoder.resize (", "preprocess: resize (PIL)"),
    ("decode_image (", "preprocess: JPEG decode"),
    ("mm_serde", "preprocess: mm_serde msgpack + base64"),
    ("image_hash (", "preprocess: blake3 content hash"),
    ("decode_data_url (", "preprocess: data URL base64 decode"),
    ("epd_kit/preprocess/text.py", "chat template, tokenize, detokenize"),
    ("epd_kit/preprocess", "preprocess: other"),
    ("json/", "JSON encode/decode (stdlib)"),
    ("pydantic", "pydantic models"),
    ("prometheus_client", "prometheus metrics"),
    ("aiohttp/", "aiohttp client (engine calls)"),
    ("httpx/", "httpx/httpcore client (engine calls)"),
    ("httpcore/", "httpx/httpcore client (engine calls)"),
    ("h11/", "uvicorn HTTP server (httptools or h11)"),
    ("httptools", "uvicorn HTTP server (httptools or h11)"),
    ("uvicorn/", "uvicorn HTTP server (httptools or h11)"),
    ("starlette/", "starlette/fastapi"),
    ("fastapi/", "starlette/fastapi"),
    ("epd_kit/router", "router logic (epd_kit.router)"),
    ("epd_kit/", "epd_kit (wire, hrw, ...)"),
    # uvloop runs the loop in C: its polling and socket I/O show as the frame that started it
    ("Runner.run (asyncio/runners.py", "event loop (uvloop: poll, socket I/O in C)"),
    ("asyncio/", "asyncio/anyio machinery"),
    ("anyio/", "asyncio/anyio machinery"),
)


def classify(frames: list[str]) -> str:
    """Innermost matching frame; the event-loop machinery only when nothing else matches
    (a socket call made for httpx is httpx's cost, not asyncio's)."""
    generic = "asyncio/anyio machinery"
    for frame in reversed(frames):
        for needle, label in BUCKETS:
            if label != generic and needle in frame:
                return label
    return generic if any("asyncio/" in f or "anyio/" in f for f in frames) else "other"


def summarize_stacks(raw: str) -> dict:
    """Collapsed py-spy stacks -> share of busy samples per bucket and the top leaf frames."""
    buckets: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = busy = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        if any(idle in frames[-1] for idle in IDLE_LEAVES):
            continue
        busy += n
        leaves[frames[-1]] += n
        buckets[classify(frames)] += n
    return {
        "samples": total,
        "busy_samples": busy,
        "share_of_busy": {k: v / busy for k, v in buckets.most_common()} if busy else {},
        "top_leaves": [(k, v / busy) for k, v in leaves.most_common(12)] if busy else [],
    }


def plot(results: dict, path: Path) -> None:
    """(a) text added latency by concurrency; (b) image added latency at c=1 (above that the
    sim VE is the bottleneck); (c) max requests/s per path; (d) proxy CPU per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = results["cells"]
    colors = {"direct": "tab:green", "floor": "tab:grey", "router": "tab:blue"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    w = 0.38

    def added(ax, rows: dict, labels: list[str], title: str) -> None:
        x = np.arange(len(labels))
        for i, cfg in enumerate(("floor", "router")):
            p50 = [max(0.0, rows[k]["added"][cfg]["p50_ms"]) for k in rows]
            p99 = [max(0.0, rows[k]["added"][cfg]["p99_ms"]) for k in rows]
            bars = ax.bar(x + (i - 0.5) * w, p50, w, color=colors[cfg], label=f"{cfg} p50")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            ax.scatter(x + (i - 0.5) * w, p99, color=colors[cfg], marker="_", s=250, label=f"{cfg} p99")
        ax.set_xticks(x, labels)
        ax.set_yscale("log")
        ax.set_ylabel("added latency vs direct (ms, log)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)

    if "text" in cells:
        added(axes[0][0], cells["text"], [f"c={c}" for c in cells["text"]], "text-only: added latency")
    else:
        axes[0][0].set_visible(False)
    img = {k: v["1"] for k, v in cells.items() if k != "text" and "1" in v}
    if img:
        added(axes[0][1], img, list(img), "one 512x512 image, concurrency 1: added latency")
    else:
        axes[0][1].set_visible(False)
    kinds = list(cells)
    x = np.arange(len(kinds))
    for i, cfg in enumerate(CONFIGS):
        rps = [results["max_rps"][k][cfg] for k in kinds]
        bars = axes[1][0].bar(x + (i - 1) * 0.27, rps, 0.27, color=colors[cfg], label=cfg)
        axes[1][0].bar_label(bars, fmt="%.0f", fontsize=7)
        if cfg != "direct":
            cpu = [np.nanmean([cells[k][c][cfg]["proxy_cpu_ms_per_1k"] / 1000 for c in cells[k]]) for k in kinds]
            bars = axes[1][1].bar(x + (i - 1.5) * w, cpu, w, color=colors[cfg], label=cfg)
            axes[1][1].bar_label(bars, fmt="%.1f", fontsize=7)
    axes[1][0].set_yscale("log")
    axes[1][0].set_title("max requests/s (closed loop, any concurrency)", fontsize=10)
    axes[1][1].set_title("proxy CPU per request (ms, mean over concurrencies)", fontsize=10)
    for ax in axes[1]:
        ax.set_xticks(x, kinds)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--text-requests", type=int, default=1500, help="per cell (bounded also by time)")
    ap.add_argument("--image-requests", type=int, default=150, help="per cell (bounded also by time)")
    ap.add_argument("--cell-seconds", type=float, default=10.0, help="time budget per path and level")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level (images)")
    ap.add_argument(
        "--text-rounds",
        type=int,
        default=10,
        help="interleaved rounds per level for text (cheap, so finer interleaving)",
    )
    ap.add_argument("--loadgen-cpu", default="0", help="CPUs for this process and the engines")
    ap.add_argument("--proxy-cpu", default="1", help="CPUs for epd-router / the floor proxy")
    ap.add_argument("--profile", action="store_true", help="py-spy the router (text, image-distinct)")
    ap.add_argument(
        "--reuse-proxies",
        action="store_true",
        help="keep one router/floor for every kind (faster; peak RSS then carries over)",
    )
    ap.add_argument("--baseline", metavar="REF", help="also run the router of git REF (path `before`)")
    ap.add_argument("--traced", action="store_true", help="also run this router with tracing on (path `traced`)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    configs = (*CONFIGS, *(["before"] if args.baseline else []), *(["traced"] if args.traced else []))
    rec = RunRecord.start("router_overhead")
    t_start = time.perf_counter()
    pin_self(args.loadgen_cpu or None)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "checkpoint")
    eng_cpu = args.loadgen_cpu or None
    proxy_cpu = args.proxy_cpu or None
    # The sim serves embedding READs from the VE's event loop, which also parses the 8 MB
    # image bodies; on one shared core a READ can wait > 1 s (the connector's default
    # transfer_timeout_sec) and the PD dies with ECLoadFailure, as a real PD would.
    ec_extra = {"transfer_timeout_sec": EC_TRANSFER_TIMEOUT_S}
    ve = engine_proc("ve", 0, ckpt, work, ec_extra=ec_extra).start(eng_cpu)
    pd = engine_proc("pd", 0, ckpt, work, ec_extra=ec_extra).start(eng_cpu)
    procs: list[Proc] = [ve, pd]
    receiver = None
    exits = contextlib.ExitStack()
    try:
        before_tree = _baseline_tree(args.baseline, work) if args.baseline else None
        if args.traced:
            from epd_kit.testing.otlp import OtlpReceiver

            receiver = exits.enter_context(OtlpReceiver())
        ve.wait_healthy()
        pd.wait_healthy()
        cells: dict = {}
        router = floor = None
        extra: dict[str, Proc] = {}
        prev_kind = ""
        for kind in args.kinds:
            # fresh proxies per kind: peak RSS is then this kind's, not memory kept from the
            # previous kind's busiest level (CPython does not give freed arenas back)
            if router is None or not args.reuse_proxies:
                for old in (router, floor, *extra.values()):
                    if old is not None:
                        old.stop()
                        procs.remove(old)
                        old.log_path.rename(old.log_path.with_name(f"{old.log_path.stem}-{prev_kind}.log"))
                router = router_proc(ckpt, [ve], [pd], work).start(proxy_cpu)
                floor = floor_proc(ve, pd, work).start(proxy_cpu)
                extra = {}
                if before_tree is not None:
                    extra["before"] = _before_proc(before_tree, ckpt, ve, pd, work).start(proxy_cpu)
                if receiver is not None:
                    traced = {"tracing": {"otlp_traces_endpoint": receiver.url}}
                    extra["traced"] = router_proc(ckpt, [ve], [pd], _subdir(work, "traced"), extra=traced)
                    extra["traced"].start(proxy_cpu)
                procs += [router, floor, *extra.values()]
                for proc in (router, floor, *extra.values()):
                    proc.wait_healthy()
                for proc in (router, *extra.values()):
                    _wait_ready(proc)
            prev_kind = kind
            ports = {"ve": ve.port, "pd": pd.port, "router": router.port, "floor": floor.port}
            ports.update({name: proc.port for name, proc in extra.items()})
            wl = Workload(kind, ckpt)
            n_max = args.text_requests if kind == "text" else args.image_requests
            cells[kind] = {}
            for c in args.concurrency:
                rounds = args.text_rounds if kind == "text" else args.rounds
                proxies = {"floor": floor, "router": router, **extra}
                cells_row = run_row(wl, ports, proxies, c, n_max, args.cell_seconds, rounds, configs)
                row: dict = {cfg: cell.__dict__ for cfg, cell in cells_row.items()}
                row["added"] = {
                    cfg: {q: row[cfg][q] - row["direct"][q] for q in ("p50_ms", "p99_ms")}
                    for cfg in configs
                    if cfg != "direct"
                }
                fl, ro = row["added"]["floor"]["p50_ms"], row["added"]["router"]["p50_ms"]
                row["router_over_floor_p50"] = ro / fl if fl > 0 else None
                cells[kind][str(c)] = row
                print(
                    f"{kind:15s} c={c:<3d} "
                    + "  ".join(
                        f"{cfg} p50 {row[cfg]['p50_ms']:7.2f} p99 {row[cfg]['p99_ms']:7.2f} ms "
                        f"{row[cfg]['rps']:6.1f}/s err {row[cfg]['errors']}"
                        for cfg in configs
                    ),
                    flush=True,
                )
        rec.results = {"cells": cells, "pinning": {"loadgen+engines": args.loadgen_cpu, "router/floor": args.proxy_cpu}}
        rec.results["max_rps"] = {
            kind: {cfg: max(cells[kind][c][cfg]["rps"] for c in cells[kind]) for cfg in configs} for kind in cells
        }
        if args.baseline:
            rec.results["baseline"] = args.baseline
        if receiver is not None:
            rec.results["traced_spans_received"] = len(receiver.spans)
        if args.profile:
            out = args.out_dir or RESULTS_DIR
            out.mkdir(parents=True, exist_ok=True)
            rec.results["profile"] = {}
            for kind in ("text", "image-distinct"):
                if kind in args.kinds:
                    wl = Workload(kind, ckpt)
                    n_max = args.text_requests if kind == "text" else args.image_requests
                    rec.results["profile"][kind] = profile_router(
                        router, wl, ports, 16, n_max, args.cell_seconds, out / f"profile-router-{kind}"
                    )
        rec.notes.append(
            f"loadgen + sim engines pinned to CPU {args.loadgen_cpu}, epd-router and the floor proxy "
            f"to CPU {args.proxy_cpu} (taskset); sim profile 'zero'; engines' transfer_timeout_sec "
            f"{EC_TRANSFER_TIMEOUT_S:g} (default 1); non-streaming, max_tokens "
            f"{MAX_TOKENS}; single run; each path and level bounded by count and {args.cell_seconds} s, "
            f"split in {args.text_rounds} (text) or {args.rounds} (images) interleaved rounds "
            "(direct, floor, router, direct, ...)"
        )
    finally:
        for p in reversed(procs):
            p.stop()
        exits.close()
        logs = (args.out_dir or RESULTS_DIR) / "logs-router_overhead"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, logs / log.name)
        shutil.rmtree(work, ignore_errors=True)
    rec.wall_s = time.perf_counter() - t_start
    path = rec.save(args.out_dir)
    if not args.no_plot:
        IMG_DIR.mkdir(parents=True, exist_ok=True)
        plot(rec.results, (args.out_dir or IMG_DIR) / "bench-router-overhead.png")
    print(f"wrote {path} in {rec.wall_s:.1f} s")
    return rec


def _subdir(work: Path, name: str) -> Path:
    """A router's own directory (its router.yaml and log beside the others')."""
    path = work / name
    path.mkdir(exist_ok=True)
    return path


def _baseline_tree(ref: str, work: Path) -> Path:
    """The kit's package at git `ref` (`git archive`), for PYTHONPATH."""
    tree = work / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "router"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree / "router"


def _before_proc(tree: Path, ckpt: Path, ve: Proc, pd: Proc, work: Path) -> Proc:
    """The baseline's router, its epd_kit from `tree` ahead of this checkout's (checked: a run
    that measured this checkout twice would say nothing)."""
    env = {"PYTHONPATH": str(tree)}
    where = subprocess.run(
        [sys.executable, "-c", "import epd_kit.router.app as m; print(m.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(tree)), f"the baseline router would import {where}, not the tree at {tree}"
    launcher = [sys.executable, "-m", "epd_kit.router.cli"]
    proc = router_proc(ckpt, [ve], [pd], _subdir(work, "before"), launcher=launcher)
    proc.extra_env = env
    proc.name = "epd-router-before"
    return proc


def _wait_ready(router: Proc, timeout_s: float = 30.0) -> None:
    assert router.process is not None, "the router was never started"
    router.process.wait_http(router.url + "/ready", timeout_s, interval=0.2)


if __name__ == "__main__":
    main()
