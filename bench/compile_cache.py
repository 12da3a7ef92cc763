"""Compile cache: what the shared tier and cache-aware rollouts save (docs/benchmarks.md "Compile cache").

Real sim engine processes on 127.0.0.1 (the tutorial's PD argv, the kit's engine environment),
three simulated hosts of two PDs each, every host with its own VLLM_CACHE_ROOT and, with the
shared tier, one NEURON_LIBTORCH_REMOTE_CACHE directory for all. The batches are the kit's own
(`epd_kit.plan.rollout.rollout_batches`, canaries for a graph change); after each batch the
kit's promotion runs (the sim's `save_cache`, as /etc/epd/promote-compile-cache does). Not
modelled: the router, draining and load (the sandbox e2e tests measure those); the figures are
engine start time only, which on trn2 is what dominates.

Scenarios, each without and with the shared tier: a cold first deploy (every engine at once),
a graph-changing rollout (a simulated Neuron SDK upgrade: every key changes), a rolling restart
with nothing changed. Bounded: 6 engines, one process per engine, each start capped.
    .venv/bin/python -m bench.compile_cache --compile-s 60 --fetch-s 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from epd_kit import plan
from epd_kit.sim.compile_cache import save_cache
from epd_kit.sim.launch import SimProcess, engine_env, free_port, pd_argv
from epd_kit.testing.checkpoint import build_tiny_checkpoint

HOSTS = ("h1", "h2", "h3")
PD_PER_HOST = 2
CORES = ("0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14,15")


def fleet_plan() -> dict:
    settings = plan.read_settings({"epd_model": "/models/tiny", "epd_engine_backend": "sim"})
    hosts = [
        plan.read_host(name, {"epd_num_ve": 0, "epd_num_pd": PD_PER_HOST, "epd_bind_address": f"10.0.0.{i}"}, settings)
        for i, name in enumerate(HOSTS, 1)
    ]
    return plan.plan_fleet(settings, hosts)


class Fleet:
    def __init__(self, root: Path, model: Path, compile_s: float, fetch_s: float, shared: bool) -> None:
        self.root, self.model, self.shared = root, model, shared
        self.sim = {"profile": "zero", "compile_s": str(compile_s), "fetch_s": str(fetch_s)}
        (root / "shared").mkdir(parents=True, exist_ok=True)
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.running: dict[tuple[str, str], SimProcess] = {}
        self.starts = 0

    def local(self, host: str) -> Path:
        return self.root / host / "neuron" / "compile_cache"

    def start(self, engines: Sequence[tuple[str, str]], sdk: str, timeout_s: float) -> None:
        """Restart these engines together and wait until every one is ready, then promote."""
        for key in engines:
            if key in self.running:
                self.running.pop(key).stop()
        started = []
        for host, instance in engines:
            env = engine_env(CORES[int(instance[-1])], **self.sim)
            env.update({"VLLM_CACHE_ROOT": str(self.root / host), "EPD_SIM_NEURON_SDK": sdk})
            if self.shared:
                env["NEURON_LIBTORCH_REMOTE_CACHE"] = str(self.root / "shared")
            self.starts += 1
            proc = SimProcess(
                pd_argv(str(self.model), free_port(), engine_id=f"epd-{host}-{instance}"),
                env,
                self.logs / f"{self.starts:03d}-{host}-{instance}.log",
            )
            self.running[(host, instance)] = proc
            started.append(proc)
        for proc in started:
            proc.wait_ready(timeout=timeout_s)
        if self.shared:
            for host in sorted({h for h, _ in engines}):
                for entry in sorted(self.local(host).glob("?" * 32)):
                    save_cache(self.local(host), self.root / "shared", entry.name)

    def stop(self) -> None:
        for proc in self.running.values():
            proc.stop()
        self.running.clear()

    def count(self, text: str) -> int:
        return sum(log.read_text(errors="replace").count(text) for log in self.logs.glob("*.log"))


def run_scenarios(model: Path, compile_s: float, fetch_s: float, shared: bool, timeout_s: float) -> dict[str, dict]:
    fleet_plan_ = fleet_plan()
    everyone = [(h, e["instance"]) for h, p in fleet_plan_.items() for e in p["engines"]]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="epd-bench-cache-") as tmp:
        fleet = Fleet(Path(tmp), model, compile_s, fetch_s, shared)
        try:

            def measure(name: str, action) -> None:
                compiles, fetches = fleet.count("compiling graph"), fleet.count("fetching graph")
                start = time.monotonic()
                action()
                results[name] = {
                    "seconds": round(time.monotonic() - start, 1),
                    "compiles": fleet.count("compiling graph") - compiles,
                    "fetches": fleet.count("fetching graph") - fetches,
                }

            def rollout(sdk: str, compiles: bool) -> None:
                batches, _ = plan.rollout_batches(fleet_plan_, compiles=compiles)
                for batch in batches:
                    fleet.start([(e["host"], e["instance"]) for e in batch.engines], sdk, timeout_s)

            measure("cold first deploy", lambda: fleet.start(everyone, "sdk-1", timeout_s))
            measure("graph-changing rollout", lambda: rollout("sdk-2", compiles=True))
            measure("no-change rolling restart", lambda: rollout("sdk-2", compiles=False))
        finally:
            fleet.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-s", type=float, default=60.0)
    parser.add_argument("--fetch-s", type=float, default=3.0)
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    args = parser.parse_args()
    if not 0 <= args.compile_s <= 600 or not 0 <= args.fetch_s <= 600:
        parser.error("--compile-s and --fetch-s must be within 0..600 s")
    with tempfile.TemporaryDirectory(prefix="epd-bench-ckpt-") as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "tiny")
        table = {
            tier: run_scenarios(model, args.compile_s, args.fetch_s, tier == "shared", args.start_timeout_s)
            for tier in ("local only", "shared")
        }
    head = f"scenario (3 hosts x 2 PD, compile {args.compile_s:g} s, fetch {args.fetch_s:g} s)"
    print(f"| {head} | local only | shared tier | shared / local |")
    print("|---|---|---|---|")
    for name in table["local only"]:
        a, b = table["local only"][name], table["shared"][name]
        cell = lambda r: f"{r['seconds']} s ({r['compiles']} compiles, {r['fetches']} fetches)"  # noqa: E731
        print(f"| {name} | {cell(a)} | {cell(b)} | {b['seconds'] / a['seconds']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
