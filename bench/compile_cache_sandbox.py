"""Compile cache in the sandbox (docs/benchmarks.md "Compile cache"): what the shared tier saves on
three real test hosts with the real deploy, under bounded load through the router, every request
counted (0 failed required). n1, n2, n3 each run 1 VE + 1 PD (the router on n1); the sim compiles
for 60 s (EPD_SIM_COMPILE_S) and fetches from the shared tier in 3 s (EPD_SIM_FETCH_S).

Each scenario without and with the shared tier (`epd_compile_cache_shared_dir` on one directory
every host mounts: hosts.sh SHARED=), on fresh hosts per tier:
  cold first deploy            deploy.yml on hosts that never compiled (no router yet: no load)
  graph-changing rollout       deploy.yml after a fleet-wide change of every key (a simulated Neuron
                               SDK upgrade, EPD_SIM_NEURON_SDK): canaries, then the rest
  no-change rolling restart    rolling_restart.yml: nothing changed, every start a local hit
For each: the playbook's wall-clock, the rollout play's share of it (deploy.yml), and the compiles
and fetches the engines logged (journal, every host).

    scripts/test.sh bench/compile_cache_sandbox.py                  # both tiers, ~30 min
    EPD_BENCH_TIERS=shared scripts/test.sh bench/compile_cache_sandbox.py

It needs the test hosts, so it runs through the test command (inside the kithub namespace, with
the machine-wide test-host lock) as a pytest module that the suite never collects (testpaths =
tests). The table is printed and written with the run's details to
<kit dir>/bench-compile-cache-sandbox.json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import Fleet, LoadGenerator, Stack, engine_pids, restarted
from tests.hosts.fixtures import host_pool  # noqa: F401 - the fixture, outside tests/ (no conftest here)
from tests.hosts.harness import REPO, HostPool, TestHost, host_address, hosts_env, playbook_command

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(3600)]

COMPILE_S = float(os.environ.get("EPD_BENCH_COMPILE_S", "60"))
FETCH_S = float(os.environ.get("EPD_BENCH_FETCH_S", "3"))
TIERS = os.environ.get("EPD_BENCH_TIERS", "local,shared").split(",")
RATE = 8  # requests/s through the router during the rollouts
LIMIT_S = 1500  # every playbook, and the load beside it, ends within this
HOSTS = ("n1", "n2", "n3")
MOUNT = "/mnt/fsx"
SHARED = f"{MOUNT}/neuron-cache"
SANDBOX = REPO / "inventory/sandbox/three-host"
ROLLOUT_PLAY = "PLAY [Drain the engines no longer planned and roll the changed engines through the router]"


def fleet(directory: Path, shared: bool) -> Fleet:
    engines = {
        name: {
            "ansible_host": host_address(i),
            "epd_bind_address": host_address(i),
            "epd_num_ve": 1,
            "epd_num_pd": 1,
            "epd_core_count": 12,  # PD tp8 + VE tp4
        }
        for i, name in enumerate(HOSTS, 1)
    }
    hosts_yml = {
        "all": {
            "children": {
                "epd_engines": {"hosts": engines},
                "epd_router": {"hosts": {"n1": None}},
                "epd_monitoring": {"hosts": {}},
            }
        }
    }
    sandbox_env = yaml.safe_load((SANDBOX / "group_vars/all/epd.yml").read_text())["epd_engine_environment"]
    group_vars = {
        "epd_engine_environment": {
            **sandbox_env,
            "EPD_SIM_COMPILE_S": f"{COMPILE_S:g}",
            "EPD_SIM_FETCH_S": f"{FETCH_S:g}",
            "EPD_SIM_NEURON_SDK": "2.27-sim",
        },
        # the printed estimate uses this sandbox's times (docs/operations.md "Compile cache")
        "epd_rollout_expected_compile_s": int(COMPILE_S) + 5,
        "epd_rollout_expected_fetch_s": int(FETCH_S) + 3,
        "epd_rollout_expected_warm_s": 3,
    }
    if shared:
        group_vars["epd_compile_cache_shared_dir"] = SHARED
    result = Fleet(directory, SANDBOX, hosts_yml, group_vars)
    result.write()
    return result


def timed_playbook(inventory: Path, playbook: str, *args: str) -> tuple[int, list[tuple[float, str]]]:
    """ansible-playbook as tests.hosts.harness.ansible_playbook runs it, each output line timestamped."""
    argv, env = playbook_command(inventory, playbook, *args)
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.monotonic() + LIMIT_S
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if time.monotonic() > deadline:
                proc.kill()
                break
        rc = proc.wait(timeout=60)
    return rc, lines


def play_seconds(lines: list[tuple[float, str]], header: str) -> float | None:
    """From the line `header` to the next PLAY line (or the end)."""
    starts = [i for i, (_, line) in enumerate(lines) if line.startswith(header)]
    if not starts:
        return None
    first = starts[0]
    end = next((t for t, line in lines[first + 1 :] if line.startswith("PLAY ")), lines[-1][0])
    return round(end - lines[first][0], 1)


def cache_events(hosts: dict[str, TestHost], since_epoch: float) -> dict[str, int]:
    """Compiles and fetches the engines of every host logged since then (docs/sim.md's log lines)."""
    counts = {"compiles": 0, "fetches": 0, "local hits": 0}
    for host in hosts.values():
        log = host.run(f"journalctl -q --no-pager -o cat --since=@{int(since_epoch)}", check=False).stdout
        counts["compiles"] += log.count("Compile cache miss: compiling graph")
        counts["fetches"] += log.count("Compile cache miss (local); fetching graph")
        counts["local hits"] += len(re.findall(r"Compilation finished\. Graph \w+: local", log))
    return counts


def scenario(stack: Stack, playbook: str, inventory: Path, *args: str) -> dict:
    """One playbook run under bounded load through the router; no request may fail."""
    since = time.time() - 1
    with LoadGenerator(
        stack.router_url, stack.model_id(), rate_per_s=RATE, max_requests=RATE * LIMIT_S, max_seconds=LIMIT_S
    ) as load:
        time.sleep(1)  # the load is flowing before the playbook starts
        start = time.monotonic()
        rc, lines = timed_playbook(inventory, playbook, *args)
        seconds = round(time.monotonic() - start, 1)
        time.sleep(1)  # ... and still after it ends
        outcome = load.stop()
    assert rc == 0, "\n".join(line for _, line in lines)[-6000:]
    assert outcome.sent >= RATE * 5, f"the load ran only {outcome.sent} requests"
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    return {
        "seconds": seconds,
        "rollout_play_s": play_seconds(lines, ROLLOUT_PLAY) if playbook.endswith("deploy.yml") else seconds,
        **cache_events(stack.hosts, since),
        "requests": outcome.sent,
        "failed": len(outcome.failures),
        # the printed plan (yaml callback: "- batch 1/5 PD+VE canary: ...")
        "plan": [
            line.strip().lstrip("- ").strip("\"',")
            for _, line in lines
            if re.search(r"^\s*-?\s*[\"']?(batch \d+/\d+|\d+ engines in|canaries first)", line)
        ],
    }


def run_tier(pool: HostPool, directory: Path, shared: bool) -> dict[str, dict]:
    inventory = fleet(directory, shared)
    results: dict[str, dict] = {}
    timings: dict[str, float] = {}
    since: list[float] = []

    def prepare(hosts: dict[str, TestHost]) -> None:
        # the kit and its user first (untimed, both tiers), then the operator gives the share to that
        # user (docs/operations.md "Compile cache")
        if shared:
            hosts["n1"].run(f"mkdir -p {SHARED}")
        rc, lines = timed_playbook(inventory.directory, "playbooks/deploy.yml", "--tags", "deps")
        assert rc == 0, "\n".join(line for _, line in lines)[-6000:]
        if shared:
            hosts["n1"].run(f"chown epd:epd {SHARED} && chmod 0750 {SHARED}")
        since.append(time.time() - 1)

    share = (pool.shared_dir("bench-compile-cache"), MOUNT) if shared else None
    # both tiers install the kit for real: their "cold first deploy" figures compare like for like
    stack = deploy_stack(
        pool, inventory.directory, timings.__setitem__, "bench", shared=share, prepare=prepare, preinstalled=False
    )
    results["cold first deploy"] = {  # deploy_stack timed it (no router before it: no load)
        "seconds": round(next(v for k, v in timings.items() if "first deploy" in k), 1),
        **cache_events(stack.hosts, since[0]),
    }

    before = engine_pids(stack, HOSTS)
    inventory.group_vars["epd_engine_environment"]["EPD_SIM_NEURON_SDK"] = "2.28-sim"  # every key changes
    inventory.write()
    results["graph-changing rollout"] = scenario(stack, "playbooks/deploy.yml", inventory.directory)
    assert restarted(before, engine_pids(stack, HOSTS)) == set(before)

    before = engine_pids(stack, HOSTS)
    results["no-change rolling restart"] = scenario(stack, "playbooks/rolling_restart.yml", inventory.directory)
    assert restarted(before, engine_pids(stack, HOSTS)) == set(before)
    assert results["no-change rolling restart"]["compiles"] == 0, results
    pool.down(*stack.hosts.values())
    return results


def cell(r: dict) -> str:
    rollout = f", rollout play {r['rollout_play_s']} s" if r.get("rollout_play_s") not in (None, r["seconds"]) else ""
    load = f"; {r['requests']} requests, {r['failed']} failed" if r.get("requests") else ""
    return f"{r['seconds']} s{rollout} ({r['compiles']} compiles, {r['fetches']} fetches{load})"


def test_compile_cache_with_and_without_the_shared_tier(host_pool, tmp_path):  # noqa: F811 - the imported fixture
    assert set(TIERS) <= {"local", "shared"} and TIERS, "EPD_BENCH_TIERS: local, shared or both"
    assert 0 < COMPILE_S <= 600 and 0 <= FETCH_S <= 120
    revision = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    table = {tier: run_tier(host_pool, tmp_path / tier, tier == "shared") for tier in TIERS}
    report = {
        "started": started,
        "revision": revision,
        "compile_s": COMPILE_S,
        "fetch_s": FETCH_S,
        "rate_per_s": RATE,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "results": table,
    }
    lines = [
        f"| scenario (3 hosts x 1 VE + 1 PD, compile {COMPILE_S:g} s, fetch {FETCH_S:g} s) | "
        + " | ".join({"local": "local only", "shared": "shared tier"}[t] for t in TIERS)
        + (" | shared / local |" if len(TIERS) == 2 else " |"),
        "|---|" + "---|" * (len(TIERS) + (1 if len(TIERS) == 2 else 0)),
    ]
    for name in table[TIERS[0]]:
        row = [cell(table[t][name]) for t in TIERS]
        if len(TIERS) == 2:
            a, b = table["local"][name], table["shared"][name]
            ratio = f"{b['seconds'] / a['seconds']:.0%}"
            if a.get("rollout_play_s") not in (None, a["seconds"]):
                ratio += f" (rollout play {b['rollout_play_s'] / a['rollout_play_s']:.0%})"
            row.append(ratio)
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    report["table"] = lines
    print("\n".join(lines))
    print(json.dumps(report, indent=2))
    (Path(hosts_env()["KIT_DIR"]) / "bench-compile-cache-sandbox.json").write_text(json.dumps(report, indent=2))
