"""Section 2 (image path): epd-router CPU per request for text, a repeated image and a new image,
the router of this checkout side by side with a baseline revision, in one run.

Both routers sit in front of the same sim VE and PD (the kit's argv, zero timing profile) and
are measured one at a time, pinned alone to one CPU, interleaved round by round and kind by
kind, so background load hits both alike. Each cell is a closed loop at concurrency 1; CPU per
request = the router process's utime+stime (all threads) over the cell ÷ requests. The
baseline's code comes from `git archive <rev> router` into a scratch directory, run with the
same venv (its dependencies are this checkout's). Request kinds:

  text            the one-sentence chat prompt, no image;
  image-repeated  one 512x512 JPEG, the same bytes every time (the router's cache hits, the
                  sim VE's encoder cache hits);
  image-new       a different JPEG every request (same pixels, a distinct JPEG comment), so
                  every request is a full preprocessing miss.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import images
from bench.common import REPO, RunRecord, percentile
from bench.httpload import Connection, Target, closed_loop, encode_post
from bench.procs import VENV_BIN, Proc, pin_self
from bench.router_overhead import summarize_stacks
from bench.stack import engine_proc, router_proc

KINDS = ("text", "image-repeated", "image-new")
PROMPT = "Describe the picture in one short sentence."
MAX_TOKENS = 8
DEFAULT_BASELINE = "0225a3a"  # the image path before its speed work (docs/benchmarks.md)


def chat_body(url: str | None) -> bytes:
    content: list | str = PROMPT
    if url is not None:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    doc = {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS}
    return json.dumps(doc).encode()


@dataclass
class Cell:
    requests: int = 0
    errors: int = 0
    cpu_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)

    def add(self, ok: int, failed: int, cpu_s: float, latencies_s: list[float]) -> None:
        self.requests += ok
        self.errors += failed
        self.cpu_s += cpu_s
        self.latencies_s += latencies_s

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "cpu_ms_per_request": 1000 * self.cpu_s / max(1, self.requests),
            "p50_ms": 1000 * percentile(self.latencies_s, 50) if self.latencies_s else None,
        }


class Bodies:
    """Client bodies per kind; image-new makes a fresh JPEG for every request of every router."""

    def __init__(self) -> None:
        self.jpeg = images.jpeg(7, 512, 512)
        self._serial = itertools.count()
        self._fixed = {"text": chat_body(None), "image-repeated": chat_body(images.data_url(self.jpeg))}

    def body(self, kind: str) -> bytes:
        if kind == "image-new":
            return chat_body(images.data_url(images.jpeg_variant(self.jpeg, next(self._serial))))
        return self._fixed[kind]


def baseline_tree(rev: str, into: Path) -> Path:
    """`router/` of revision `rev` (git archive), importable as epd_kit from the returned path."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "router"], capture_output=True, check=True, timeout=60
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "router"


def start_router(
    name: str, checkpoint: Path, ve: Proc, pd: Proc, work: Path, code: Path | None, cpu: str, limits: dict
) -> Proc:
    launcher = [sys.executable, "-m", "epd_kit.router.cli"]
    (work / name).mkdir(parents=True, exist_ok=True)
    extra = {"limits": limits} if limits else None
    proc = router_proc(checkpoint, [ve], [pd], work / name, extra=extra, launcher=launcher)
    proc.name = name
    if code is not None:
        proc.extra_env["PYTHONPATH"] = str(code)
    return proc.start(cpus=cpu)


async def measure(router: Proc, bodies: Bodies, kind: str, n: int, deadline_s: float) -> tuple[int, int, float, list]:
    target = Target("127.0.0.1", router.port)

    async def one(conns: dict[str, Connection], _idx: int) -> tuple[bool, float]:
        raw = encode_post("/v1/chat/completions", bodies.body(kind), router.port)
        resp = await conns["router"].request(raw)
        return resp.status == 200, resp.first_byte_s

    cpu0 = router.cpu_s()
    res = await closed_loop({"router": target}, one, concurrency=1, max_requests=n, deadline_s=deadline_s)
    cpu = router.cpu_s() - cpu0
    ok = [s for s in res.samples if s.ok]
    return len(ok), len(res.samples) - len(ok), cpu, [s.latency_s for s in ok]


def profile(router: Proc, bodies: Bodies, kind: str, n: int, deadline_s: float, out: Path) -> dict:
    """py-spy (every thread) on `router` while `n` requests of `kind` run; the share of busy
    samples per part of the router and the top leaf frames (bench.router_overhead's buckets)."""
    spy = shutil.which("py-spy", path=str(VENV_BIN)) or shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy not installed (the bench extra)"}
    raw = out / f"py-spy-{kind}.txt"
    argv = [spy, "record", "-p", str(router.pid), "-r", "200", "-f", "raw", "-o", str(raw), "--threads"]
    argv += ["--nonblocking", "-d", str(int(deadline_s) + 2)]
    spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    asyncio.run(measure(router, bodies, kind, n, deadline_s))
    try:
        spy_proc.wait(timeout=deadline_s + 30)
    except subprocess.TimeoutExpired:
        spy_proc.kill()
        return {"skipped": "py-spy did not finish"}
    if not raw.exists():
        return {"skipped": "py-spy wrote no profile"}
    return summarize_stacks(raw.read_text())


def run(args: argparse.Namespace, work: Path) -> dict:
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(work / "checkpoint")
    code = {"current": args.current_tree, "baseline": baseline_tree(args.baseline, work / "baseline")}
    engines = [engine_proc("ve", 0, checkpoint, work), engine_proc("pd", 0, checkpoint, work)]
    limits = {"image_cache_items": args.image_cache_items} if args.image_cache_items is not None else {}
    procs: list[Proc] = []
    try:
        for p in engines:
            procs.append(p.start(cpus=args.engine_cpu))
        for p in engines:
            p.wait_healthy()
        routers = {
            name: start_router(name, checkpoint, engines[0], engines[1], work, tree, args.router_cpu, limits)
            for name, tree in code.items()
        }
        procs += routers.values()
        for r in routers.values():
            r.wait_healthy()
        bodies = Bodies()
        cells = {name: {kind: Cell() for kind in KINDS} for name in routers}
        for r in routers.values():  # warm up: imports, the repeated image, first connections
            for kind in KINDS:
                asyncio.run(measure(r, bodies, kind, args.warmup, 30.0))
        for _ in range(args.rounds):
            for kind in KINDS:
                n = args.text_requests if kind == "text" else args.image_requests
                for name, r in routers.items():
                    cells[name][kind].add(*asyncio.run(measure(r, bodies, kind, n, args.deadline_s)))
        profiles = {
            kind: profile(routers["current"], bodies, kind, args.image_requests, args.deadline_s, work)
            for kind in ("image-repeated", "image-new")
            if args.profile
        }
    finally:
        for p in reversed(procs):
            p.stop()
    out = {name: {kind: c.summary() for kind, c in kinds.items()} for name, kinds in cells.items()}
    cpu = {name: {kind: cell["cpu_ms_per_request"] for kind, cell in kinds.items()} for name, kinds in out.items()}
    out["ratios"] = {
        "repeated_over_text_current": _ratio(cpu["current"]["image-repeated"], cpu["current"]["text"]),
        "repeated_over_text_baseline": _ratio(cpu["baseline"]["image-repeated"], cpu["baseline"]["text"]),
        "new_current_over_baseline": _ratio(cpu["current"]["image-new"], cpu["baseline"]["image-new"]),
        "repeated_current_over_baseline": _ratio(cpu["current"]["image-repeated"], cpu["baseline"]["image-repeated"]),
    }
    out["baseline_revision"] = args.baseline
    out["sim_decode"] = sim_decode(checkpoint)
    out["profiles"] = profiles
    return out


def _ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 (CPU time is counted in 10 ms ticks: a tiny run may see none)."""
    return a / b if b else None


def sim_decode(checkpoint: Path, repeats: int = 20) -> dict:
    """What a sim VE pays to read one 512x512 item from its body: the stdlib's validating
    base64 decode (the sim before) against mm_serde's (pybase64, as vLLM's mm_serde), and
    the whole item decode; best of `repeats`, ms."""
    import base64

    from epd_kit import mm_serde
    from epd_kit.preprocess.preprocessor import Preprocessor

    pre = Preprocessor.from_checkpoint(checkpoint, workers=1)
    text = (
        asyncio.run(
            pre.render(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": images.data_url(images.jpeg(7, 512, 512))}}
                        ],
                    }
                ]
            )
        )
        .items[0]
        .ve_kwargs
    )
    asyncio.run(pre.aclose())

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1000 * min(times)

    return {
        "item_base64_bytes": len(text),
        "stdlib_b64decode_validate_ms": best(lambda: base64.b64decode(text, validate=True)),
        "pybase64_b64decode_validate_ms": best(lambda: mm_serde._b64decode(text, validate=True)),
        "decode_item_b64_ms": best(lambda: mm_serde.decode_item_b64(text)),
    }


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.image_path", description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the router to compare with")
    ap.add_argument(
        "--current-tree", type=Path, default=None, help="a router/ directory to run instead of this checkout's"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--text-requests", type=int, default=200, help="per cell (also bounded by --deadline-s)")
    ap.add_argument("--image-requests", type=int, default=40, help="per cell (also bounded by --deadline-s)")
    ap.add_argument("--deadline-s", type=float, default=8.0, help="wall-time bound of one cell")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded requests per router and kind")
    ap.add_argument("--router-cpu", default="1", help="CPU the routers are pinned to")
    ap.add_argument("--engine-cpu", default="0", help="CPU of the sims and the load generator")
    ap.add_argument(
        "--image-cache-items",
        type=int,
        default=None,
        help="limits.image_cache_items of both routers (default: the router's); small = a full cache, evicting",
    )
    ap.add_argument("--profile", action="store_true", help="py-spy this checkout's router on the image kinds")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    pin_self(args.engine_cpu or None)
    rec = RunRecord.start("image_path")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="epd-bench-image-path-") as tmp:
        rec.results = run(args, Path(tmp))
    rec.notes.append(
        f"routers pinned to CPU {args.router_cpu}, sims and load generator to CPU {args.engine_cpu}; "
        f"{args.rounds} interleaved rounds; concurrency 1"
    )
    rec.wall_s = time.perf_counter() - t0
    path = rec.save(args.out_dir)
    res = rec.results
    for kind in KINDS:
        line = "  ".join(
            f"{name} {res[name][kind]['cpu_ms_per_request']:6.2f} ms ({res[name][kind]['requests']} req, "
            f"{res[name][kind]['errors']} err)"
            for name in ("baseline", "current")
        )
        print(f"{kind:15s} CPU per request: {line}")
    for key, value in res["ratios"].items():
        print(f"{key}: {'-' if value is None else f'{value:.2f}'}")
    for kind, prof in res["profiles"].items():
        shares = prof.get("share_of_busy", {})
        print(f"profile {kind}: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items() if v >= 0.03))
    print("sim VE, one 512x512 item:", ", ".join(f"{k} {v:.2f}" for k, v in res["sim_decode"].items()))
    print(f"wrote {path} in {rec.wall_s:.1f} s")
    return rec


if __name__ == "__main__":
    main()
