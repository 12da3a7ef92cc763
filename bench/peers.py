"""Peers: epd-router beside the Rust gateways vllm-router and sglang-router, text chat requests,
the same C stub engines behind every proxy, in one run.

    stubs   bench/stub_engine.c (built here with cc): canned answers, no work, epoll, keep-alive
    load    Debian's wrk (C, keep-alive) with bench/wrk/chat.lua for the POST body (each request's
            prompt numbered: no two alike) and summary
    proxies vllm-router and sglang-router from PyPI (a cached venv under /var/tmp), epd-router
            serve with a router.yaml like the one Ansible renders (tiny checkpoint: real chat
            template and tokenizer), optionally epd-router at an older revision (--baseline)

Pinning: wrk and the stubs on CPU 0, the proxy under test alone on CPU 1 (the others are
stopped while it is measured). Per proxy and round: a warm-up, c=1 for the added p50 (the
proxy's p50 minus the stubs' own p50 measured directly in the same round), then c=16 and
c=64; CPU per request = the proxy's CPU time delta in nanoseconds (each thread's
/proc/<pid>/task/<tid>/schedstat, every process of the proxy) over the requests wrk
completed. epd-router logs at `--log-level`
(default INFO, the level the kit deploys: one line per request); the peers at warning, their
quietest level that still reports problems (neither logs a line per request at info either
way: vllm-router's per-request lines are at debug). Rounds interleave the proxies; the
tables report medians over rounds. For epd-router also a burst after `--idle-s` of idleness
against a warm burst (CPU per request): kept-alive engine connections must survive the pause.
Every wrk run is bounded in time; everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import REPO, RunRecord
from bench.procs import Proc, free_port
from bench.stack import router_proc

PEERS = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
CACHE = Path("/var/tmp/epd-kit/bench")  # the stub's binary, baseline trees
PEERS_VENV = Path("/var/tmp/epd-kit/peers-venv")
STUB_SRC = REPO / "bench" / "stub_engine.c"
WRK_SCRIPT = REPO / "bench" / "wrk" / "chat.lua"
LOAD_CPU, PROXY_CPU = "0", "1"
MAX_TOKENS = 16
# VARY_N: bench/wrk/chat.lua puts a counter there, so no two requests send the same prompt and
# no cache keyed on the request (none in any proxy measured today) can flatter a proxy
BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "Request VARY_N: describe a sunrise over the sea in one short sentence."}],
    "max_tokens": MAX_TOKENS,
}


# --- the tools: stub engine, wrk, the peers' venv ------------------------------------------


def build_stub() -> Path:
    exe = CACHE / "stub_engine"
    if not exe.exists() or exe.stat().st_mtime < STUB_SRC.stat().st_mtime:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cc", "-O2", "-o", str(exe), str(STUB_SRC)], check=True)
    return exe


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found is None:  # Debian's package; the bench runs as root like the rest of the sandbox
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, stdout=subprocess.DEVNULL)
        found = shutil.which("wrk")
    assert found, "wrk is not installed (apt-get install wrk)"
    return found


def ensure_peers() -> dict[str, str]:
    """The peers' versions as installed in the cached venv (installed from PyPI when missing)."""
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    wanted = [f"{name}=={version}" for name, version in PEERS.items()]
    if any(not (PEERS_VENV / "bin" / name).exists() for name in PEERS):
        subprocess.run([str(py), "-m", "pip", "install", "-q", *wanted], check=True)
    out = subprocess.run(
        [str(py), "-m", "pip", "show", *PEERS], capture_output=True, text=True, check=True
    ).stdout.split("\n---\n")
    return {b.split("Name: ")[1].split()[0]: b.split("Version: ")[1].split()[0] for b in out if "Name: " in b}


# --- processes ------------------------------------------------------------------------------


def stub(name: str, exe: Path, work: Path) -> Proc:
    port = free_port()
    return Proc(name=name, argv=[str(exe), str(port)], port=port, health_path="/health", log_path=work / f"{name}.log")


def gateway(name: str, pds: list[Proc], work: Path) -> Proc:
    """vllm-router / sglang-router over the PD stubs, round robin, logging warnings only."""
    port = free_port()
    exe = str(PEERS_VENV / "bin" / name)
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *(p.url for p in pds)]
    common += ["--policy", "round_robin", "--prometheus-port", str(free_port())]
    argv = [exe, *common, "--log-level", "warning"] if name == "vllm-router" else [exe, "launch", *common]
    if name == "sglang-router":
        argv += ["--log-level", "warn"]
    return Proc(name=name, argv=argv, port=port, health_path="/health", log_path=work / f"{name}.log")


def baseline_router(rev: str, ckpt: Path, ve: list[Proc], pd: list[Proc], work: Path) -> Proc:
    """epd-router as of `rev` (its router/ tree extracted with git archive, nothing checked out)."""
    tree = CACHE / f"baseline-{rev}"
    if not (tree / "router").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "router"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    launcher = [sys.executable, "-c", "from epd_kit.router.cli import main; main()"]
    (work / f"baseline-{rev}").mkdir(exist_ok=True)
    proc = router_proc(ckpt, ve, pd, work / f"baseline-{rev}", launcher=launcher)
    proc.name = f"epd-router @{rev}"
    proc.extra_env = {"PYTHONPATH": str(tree / "router")}
    return proc


def wait_serving(proc: Proc, timeout_s: float = 60.0) -> None:
    """Until one chat request through `proc` answers 200 (the gateways register workers
    asynchronously after they start listening)."""

    def serves() -> bool:
        try:
            return (
                httpx.post(proc.url + "/v1/chat/completions", json=BODY, timeout=2.0, trust_env=False).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    assert proc.process is not None, f"{proc.name} was never started"
    proc.process.wait_until(serves, timeout_s, "serving", interval=0.2)


def cpu_ns(pid: int) -> int:
    """CPU time in nanoseconds of `pid` and every descendant still alive (a launcher may fork
    the server), every thread: the first field of each task's /proc/<pid>/task/<tid>/schedstat
    (time on a CPU, ns; the kernel's sched_info). utime+stime count in clock ticks (10 ms), too
    coarse for a fraction of a millisecond per request over a few thousand requests. The
    proxies' threads live as long as they do, so no exited thread's time is missed."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue  # the thread ended between the listing and the read
        todo += children.get(p, [])
    return total


# --- measurement ------------------------------------------------------------------------


@dataclass
class WrkResult:
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    rps: float
    cpu_ms_per_req: float | None = None


def run_wrk(wrk: str, url: str, body_file: Path, conc: int, seconds: float, pid: int | None = None) -> WrkResult:
    argv = ["taskset", "-c", LOAD_CPU, wrk, "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--timeout", "10s"]
    argv += ["-s", str(WRK_SCRIPT), url + "/v1/chat/completions"]
    before = cpu_ns(pid) if pid else 0
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, "WRK_BODY_FILE": str(body_file)},
        timeout=seconds + 30,
        check=True,
    ).stdout
    after = cpu_ns(pid) if pid else 0
    line = next(x for x in out.splitlines() if x.startswith("wrk-summary "))
    doc = json.loads(line.removeprefix("wrk-summary "))
    n = doc["requests"]
    return WrkResult(
        requests=n,
        errors=doc["errors"] + doc["non_2xx"],
        p50_ms=doc["p50_us"] / 1000,
        p99_ms=doc["p99_us"] / 1000,
        rps=n / (doc["duration_us"] / 1e6),
        cpu_ms_per_req=(after - before) / 1e6 / n if pid and n else None,
    )


@dataclass
class Cell:
    """One proxy in one round."""

    direct_p50_ms: float
    c1: WrkResult
    c16: WrkResult
    c64: WrkResult

    @property
    def added_p50_ms(self) -> float:
        return self.c1.p50_ms - self.direct_p50_ms


@dataclass
class Peer:
    name: str
    does: str
    proc: Proc
    cells: list[Cell] = field(default_factory=list)


def measure(peer: Peer, wrk: str, direct_url: str, body: Path, seconds: float) -> Cell:
    """The proxy must be running (and alone on its CPU); it is left running."""
    run_wrk(wrk, peer.proc.url, body, 64, 1)  # warm-up: engine pools, caches
    direct = run_wrk(wrk, direct_url, body, 1, seconds)
    c1 = run_wrk(wrk, peer.proc.url, body, 1, seconds, peer.proc.pid)
    c16 = run_wrk(wrk, peer.proc.url, body, 16, seconds, peer.proc.pid)
    c64 = run_wrk(wrk, peer.proc.url, body, 64, seconds, peer.proc.pid)
    return Cell(direct.p50_ms, c1, c16, c64)


def idle_burst(peer: Peer, wrk: str, body: Path, idle_s: float, seconds: float) -> dict:
    """CPU per request of a c=64 burst right after another (warm) and after `idle_s` idle."""
    run_wrk(wrk, peer.proc.url, body, 64, 1)
    warm = run_wrk(wrk, peer.proc.url, body, 64, seconds, peer.proc.pid)
    time.sleep(idle_s)
    cold = run_wrk(wrk, peer.proc.url, body, 64, seconds, peer.proc.pid)
    assert warm.cpu_ms_per_req and cold.cpu_ms_per_req
    return {
        "idle_s": idle_s,
        "warm_cpu_ms_per_req": warm.cpu_ms_per_req,
        "cold_cpu_ms_per_req": cold.cpu_ms_per_req,
        "cold_over_warm": cold.cpu_ms_per_req / warm.cpu_ms_per_req,
        "warm_rps": warm.rps,
        "cold_rps": cold.rps,
    }


def profile(peer: Peer, wrk: str, body: Path, seconds: float, work: Path) -> dict:
    """py-spy (every thread, 200 Hz) on the proxy while wrk runs c=16 for `seconds`: the share
    of its busy samples per stage (bench.router_overhead's buckets) and the top leaf frames."""
    from bench.router_overhead import summarize_stacks

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy not installed (the bench extra)"}
    run_wrk(wrk, peer.proc.url, body, 16, 1)  # warm-up
    raw = work / "py-spy-c16.txt"
    argv = [spy, "record", "-p", str(peer.proc.pid), "-r", "200", "-f", "raw", "-o", str(raw)]
    spy_proc = subprocess.Popen([*argv, "-d", str(round(seconds) + 1)], stdout=subprocess.DEVNULL)
    try:
        load = run_wrk(wrk, peer.proc.url, body, 16, seconds, peer.proc.pid)
        spy_proc.wait(timeout=seconds + 30)
    finally:
        if spy_proc.poll() is None:
            spy_proc.kill()
    if not raw.exists():
        return {"skipped": "py-spy wrote no profile"}
    summary = summarize_stacks(raw.read_text())
    return {**summary, "raw": str(raw), "requests": load.requests, "cpu_ms_per_req": load.cpu_ms_per_req}


def median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(peer: Peer) -> dict:
    cells = peer.cells
    return {
        "does": peer.does,
        "added_p50_ms": median([c.added_p50_ms for c in cells]),
        "cpu_ms_per_req_c1": median([c.c1.cpu_ms_per_req or 0 for c in cells]),
        "cpu_ms_per_req_c16": median([c.c16.cpu_ms_per_req or 0 for c in cells]),
        "cpu_ms_per_req_c64": median([c.c64.cpu_ms_per_req or 0 for c in cells]),
        "rps_c64": median([c.c64.rps for c in cells]),
        "p99_ms_c64": median([c.c64.p99_ms for c in cells]),
        "errors": sum(c.c1.errors + c.c16.errors + c.c64.errors for c in cells),
        "rounds": [
            {"added_p50_ms": c.added_p50_ms, "direct_p50_ms": c.direct_p50_ms, "c1": c.c1, "c16": c.c16, "c64": c.c64}
            for c in cells
        ],
    }


def markdown(results: dict, reference: str) -> str:
    ref = results[reference]
    rows = [
        "| proxy | added p50 at c=1 | CPU per request c=1 / c=16 / c=64 | req/s at c=64 |"
        " CPU ÷ vllm-router c=16 / c=64 | added p50 ÷ vllm-router |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio16 = r["cpu_ms_per_req_c16"] / ref["cpu_ms_per_req_c16"]
        ratio64 = r["cpu_ms_per_req_c64"] / ref["cpu_ms_per_req_c64"]
        p50_ratio = r["added_p50_ms"] / ref["added_p50_ms"] if ref["added_p50_ms"] > 0 else float("nan")
        rows.append(
            f"| {name} | {r['added_p50_ms']:.2f} ms | {r['cpu_ms_per_req_c1']:.2f} / {r['cpu_ms_per_req_c16']:.2f} / "
            f"{r['cpu_ms_per_req_c64']:.2f} ms | {r['rps_c64']:,.0f} | {ratio16:.1f}× / {ratio64:.1f}× "
            f"| {p50_ratio:.1f}× |"
        )
    return "\n".join(rows)


DOES = {
    "vllm-router": "forwards the OpenAI JSON to a worker's /v1/chat/completions (round robin), relays the answer",
    "sglang-router": "same, through its policy registry and middleware (round robin), relays the answer",
    "epd-router": "validates the OpenAI body, renders the chat template, tokenizes, picks a PD, sends a vLLM "
    "generate body, parses the token ids, detokenizes, builds the OpenAI answer, metrics",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="each wrk run (c=1 and c=64)")
    ap.add_argument("--idle-s", type=float, default=30.0, help="pause before epd-router's cold burst (0: skip)")
    ap.add_argument("--baseline", metavar="REV", help="also run epd-router as of git revision REV")
    ap.add_argument("--no-peers", action="store_true", help="epd-router (and --baseline) only")
    ap.add_argument("--log-level", default="INFO", help="epd-router's (INFO: the deployed default)")
    ap.add_argument(
        "--profile-s", type=float, default=0.0, help="after the rounds, py-spy epd-router under c=16 this long (0: no)"
    )
    args = ap.parse_args(argv)
    if os.cpu_count() is None or os.cpu_count() < 2:
        sys.exit("needs 2 CPUs: the load and stubs on CPU 0, the proxy under test on CPU 1")

    rec = RunRecord.start("peers")
    t0 = time.monotonic()
    exe, wrk = build_stub(), ensure_wrk()
    versions = {} if args.no_peers else ensure_peers()
    rec.notes.append(f"versions: {versions}")
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="epd-peers-"))
    body = work / "body.json"
    body.write_text(json.dumps(BODY))
    ckpt = build_tiny_checkpoint(work / "checkpoint")
    stubs = [stub(name, exe, work) for name in ("stub-ve-0", "stub-pd-0", "stub-pd-1")]
    peers: list[Peer] = []
    try:
        for s in stubs:
            s.start(LOAD_CPU).wait_healthy()
        ve, pds = stubs[:1], stubs[1:]
        if not args.no_peers:
            peers += [Peer(f"{n} {versions.get(n, '?')}", DOES[n], gateway(n, pds, work)) for n in PEERS]
        if args.baseline:
            peers.append(
                Peer(
                    f"epd-router @{args.baseline}",
                    DOES["epd-router"],
                    baseline_router(args.baseline, ckpt, ve, pds, work),
                )
            )
        peers.append(Peer("epd-router", DOES["epd-router"], router_proc(ckpt, ve, pds, work)))
        for peer in peers:  # bench/stack.py starts routers at WARNING: the level under test instead
            if peer.name.startswith("epd-router"):
                argv = peer.proc.argv
                argv[argv.index("--log-level") + 1] = args.log_level
        rec.notes.append(f"epd-router log level: {args.log_level}")
        for rnd in range(args.rounds):
            for peer in peers:  # one proxy alive at a time: it has CPU 1 to itself
                peer.proc.start(PROXY_CPU)
                try:
                    wait_serving(peer.proc)
                    peer.cells.append(measure(peer, wrk, pds[0].url, body, args.seconds))
                    if args.idle_s and rnd == 0 and peer.name.startswith("epd-router"):
                        rec.results.setdefault("idle_burst", {})[peer.name] = idle_burst(
                            peer, wrk, body, args.idle_s, args.seconds
                        )
                finally:
                    peer.proc.stop()
                print(f"round {rnd + 1}: {peer.name} done", file=sys.stderr)
        if args.profile_s:
            ours = peers[-1]  # this checkout's epd-router
            ours.proc.start(PROXY_CPU)
            try:
                wait_serving(ours.proc)
                rec.results["profile_c16"] = profile(ours, wrk, body, args.profile_s, work)
            finally:
                ours.proc.stop()
    finally:
        for p in [*(x.proc for x in peers), *stubs]:
            p.stop()
    results = {p.name: summarize(p) for p in peers}
    rec.results["proxies"] = results
    reference = next((n for n in results if n.startswith("vllm-router")), next(iter(results)))
    rec.results["markdown"] = markdown(results, reference)
    rec.wall_s = time.monotonic() - t0
    path = rec.save()
    print(rec.results["markdown"])
    print(json.dumps(rec.results.get("idle_burst", {}), indent=1))
    if "profile_c16" in rec.results:
        print(json.dumps(rec.results["profile_c16"], indent=1))
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
