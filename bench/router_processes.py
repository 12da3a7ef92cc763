"""Router processes on one listener (docs/benchmarks.md "Router processes"): text throughput of
1 and 2 epd-router processes that accept from one shared socket, as systemd's epd-router.socket
gives them (docs/router.md "Scale-out").

    python -m bench.router_processes [--seconds 10] [--connections 64] [--repeats 3]

Behind the routers: C stub engines (bench/stub_engine.c, built into /var/tmp; one thread, no
work), so the engines cost next to nothing; in front: Debian's `wrk` (C) with a Lua script
posting one text chat request (max_tokens 16). On this 2-core machine the routers get both
cores in both runs (their share is what scales) and the stubs and wrk run on the same cores:
what they cost is the same per request in both runs, so the ratio is the router's. Each
configuration runs `--repeats` times, alternating; the table reports medians. Only 127.0.0.1.

`router_group` is also the tests' way to run several router processes on one socket without
systemd (tests/router_processes/test_multiprocess.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.common import REPO
from bench.procs import VENV_BIN, Proc, cpu_seconds, free_port, taskset_prefix
from epd_kit.testing.process import ManagedProcess, http_ok, stop_all

STUB_SOURCE = REPO / "bench" / "stub_engine.c"
STUB_BINARY = Path("/var/tmp/epd-kit/bench/stub_engine")

# what systemd does for a socket unit with Accept=no: the listening socket as fd 3, LISTEN_FDS=1 and
# LISTEN_PID = the pid of the process that will be the router (this one, which then execs it)
SOCKET_ACTIVATE = """import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclass
class RouterGroup:
    """N `epd-router serve --worker K` processes accepting from one listening socket."""

    port: int
    metrics_dir: Path
    members: list[ManagedProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [member.popen for member in self.members]

    def cpu_s(self) -> float:
        """utime + stime of every router process (whole processes, every thread)."""
        return sum(cpu_seconds(member.pid) for member in self.members)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Every process has started (each answers /health once it accepts; a poll through the
        shared socket reaches any of them, so wait for each one's metrics files instead)."""

        def ready() -> bool:
            for member in self.members:
                member.check_running()
            started = all(any(self.metrics_dir.glob(f"*_{worker}.db")) for worker in range(len(self.members)))
            return started and http_ok(self.url + "/ready")

        self.members[0].wait_until(ready, timeout_s, "ready (every router process)", interval=0.1)


@contextlib.contextmanager
def router_group(config: Path, workers: int, work_dir: Path, cpus: str | None = None) -> Iterator[RouterGroup]:
    """Bind 127.0.0.1:<free port>, start `workers` router processes on it (their logs in
    work_dir), yield when all are ready; SIGTERM them on exit (own pids only)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    metrics_dir = work_dir / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    group = RouterGroup(port=listener.getsockname()[1], metrics_dir=metrics_dir)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    try:
        for worker in range(workers):
            argv = [str(VENV_BIN / "epd-router"), "serve", "--config", str(config), "--worker", str(worker)]
            group.members.append(
                ManagedProcess(
                    [*taskset_prefix(cpus), sys.executable, "-c", SOCKET_ACTIVATE, str(listener.fileno()), *argv],
                    work_dir / f"router-{worker}.log",
                    env=env,
                    name=f"router process {worker}",
                    pass_fds=[listener.fileno()],
                )
            )
        group.wait_healthy()
        yield group
    finally:
        stop_all(group.members, 15)
        listener.close()


def stub_engine(work_dir: Path, name: str) -> Proc:
    """One C stub engine on a free port (built once from bench/stub_engine.c)."""
    if not STUB_BINARY.exists() or STUB_BINARY.stat().st_mtime < STUB_SOURCE.stat().st_mtime:
        STUB_BINARY.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cc", "-O2", "-o", str(STUB_BINARY), str(STUB_SOURCE)], check=True)
    port = free_port()
    return Proc(
        name=name,
        argv=[str(STUB_BINARY), str(port)],
        port=port,
        health_path="/health",
        log_path=work_dir / f"{name}.log",
    )


def write_router_config(path: Path, checkpoint: Path, ve: Proc, pd: Proc) -> Path:
    config = {
        "model": str(checkpoint),
        "listen": {"host": "127.0.0.1", "port": 0},
        "endpoints": {
            "ve": [{"id": ve.name, "url": ve.url}],
            "pd": [{"id": pd.name, "url": pd.url}],
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


_WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
done = function(summary, latency, requests)
  io.write(string.format("EPD {{\\"requests\\": %d, \\"errors\\": %d, \\"non2xx\\": %d, \\"p50_ms\\": %.3f}}\\n",
    summary.requests, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, latency:percentile(50) / 1000))
end
"""


def wrk_run(url: str, seconds: float, connections: int, work_dir: Path) -> dict:
    """Closed-loop load for `seconds` (bounded by wrk itself); 127.0.0.1 only."""
    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"benchmarks only send to 127.0.0.1, not {url}")
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
    script = work_dir / "chat.lua"
    script.write_text(_WRK_SCRIPT.format(body=body))
    threads = min(2, connections)
    result = subprocess.run(
        [
            "wrk",
            "-t",
            str(threads),
            "-c",
            str(connections),
            "-d",
            f"{seconds:g}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
        ]
        + [url + "/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    )
    line = next(line for line in result.stdout.splitlines() if line.startswith("EPD "))
    summary = json.loads(line[4:])
    summary["rps"] = summary["requests"] / seconds
    return summary


def busy_cores_s() -> float:
    """CPU-seconds the whole machine has been busy (every core, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(workers: int, config: Path, seconds: float, connections: int, work_dir: Path, stubs: list[Proc]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"w{workers}-", dir=work_dir))
    with router_group(config, workers, run_dir) as group:
        wrk_run(group.url, 2, connections, run_dir)  # warm-up: connections, tokenizer caches
        router_before, stubs_before, machine_before = group.cpu_s(), sum(p.cpu_s() for p in stubs), busy_cores_s()
        wrk_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = wrk_run(group.url, seconds, connections, run_dir)
        wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        router_s = group.cpu_s() - router_before
        harness_s = sum(p.cpu_s() for p in stubs) - stubs_before
        harness_s += (wrk_after.ru_utime + wrk_after.ru_stime) - (wrk_before.ru_utime + wrk_before.ru_stime)
        summary["router_cpu_ms_per_request"] = router_s * 1000 / max(1, summary["requests"])
        summary["router_cores"] = router_s / seconds
        summary["wrk_and_stubs_cores"] = harness_s / seconds
        # what else ran on the machine meanwhile (other jobs on a shared VM skew the ratio)
        summary["other_cores"] = (busy_cores_s() - machine_before - router_s - harness_s) / seconds
        metrics = httpx.get(group.url + "/metrics", timeout=5).text
        served = sum(float(v) for v in re.findall(r'^epd_router_requests_total\{status="200"\} (\S+)$', metrics, re.M))
        summary["metrics_requests_200"] = served
    summary["workers"] = workers
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here")
    args = parser.parse_args()

    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="epd-router-processes-"))
    checkpoint = build_tiny_checkpoint(work / "checkpoint")
    engines = [stub_engine(work, "epd-ve-0").start(), stub_engine(work, "epd-pd-0").start()]
    try:
        for engine in engines:
            engine.wait_healthy()
        config = write_router_config(work / "router.yaml", checkpoint, *engines)
        runs: list[dict] = []
        for _ in range(args.repeats):
            for workers in args.workers:
                runs.append(measure(workers, config, args.seconds, args.connections, work, engines))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for engine in engines:
            engine.stop()
    medians = {
        w: {
            key: statistics.median(r[key] for r in runs if r["workers"] == w)
            for key in (
                "rps",
                "p50_ms",
                "router_cpu_ms_per_request",
                "router_cores",
                "wrk_and_stubs_cores",
                "other_cores",
            )
        }
        for w in args.workers
    }
    base = medians[args.workers[0]]["rps"]
    print(
        f"\nrouter processes, text chat, max_tokens 16, c={args.connections}, {args.seconds:g} s, "
        f"median of {args.repeats}, cores: {os.cpu_count()}"
    )
    columns = ["processes", "req/s", "× one", "p50 ms", "router CPU ms/request", "router cores"]
    columns += ["wrk+stubs cores", "other jobs, cores"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for w, m in medians.items():
        cpu = m["router_cpu_ms_per_request"]
        print(
            f"| {w} | {m['rps']:.0f} | {m['rps'] / base:.2f} | {m['p50_ms']:.1f} | {cpu:.2f} | {m['router_cores']:.2f} "
            f"| {m['wrk_and_stubs_cores']:.2f} | {m['other_cores']:.2f} |"
        )
    errors = sum(r["errors"] + r["non2xx"] for r in runs)
    print(f"failed requests over all runs: {errors}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
