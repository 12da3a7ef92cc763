"""Where an idempotent re-deploy's time goes (docs/benchmarks.md "Idempotent re-deploy"): the
one-host and the three-host sandbox (inventory/sandbox/one-host, three-host) are booted and
deployed once, then `deploy.yml` runs again EPD_BENCH_RUNS times (default 3) with a per-task timer
(bench/callback_plugins/epd_task_timer.py). Printed and written to
<kit dir>/bench-deploy-timer.json: each run's wall-clock, its changed= count, the load average,
and the 20 slowest tasks (mean seconds over the runs).

    scripts/test.sh bench/deploy_timer.py                       # this tree, both layouts, ~5 min
    EPD_BENCH_REF=067e3d3 scripts/test.sh bench/deploy_timer.py # and that commit's deploy.yml beside it

With EPD_BENCH_REF the commit's tree (git archive) re-deploys the same hosts in turn with this
tree's (ref, this, ref, this, ...), so the two are compared side by side at the same load; both
deploy the same files (the render is byte-identical), so neither run undoes the other's.
EPD_BENCH_LAYOUTS=one-host picks layouts. It needs the test hosts, so it runs through the test
command (inside kithub, under the machine-wide test-host lock) as a pytest module the suite never
collects (testpaths = tests)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import deploy_stack, sandbox_inventory
from tests.hosts.fixtures import host_pool  # noqa: F401 - the fixture, outside tests/ (no conftest here)
from tests.hosts.harness import REPO, HostPool, hosts_env, playbook_command

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1800)]

RUNS = int(os.environ.get("EPD_BENCH_RUNS", "3"))
REF = os.environ.get("EPD_BENCH_REF", "")
LAYOUTS = os.environ.get("EPD_BENCH_LAYOUTS", "one-host,three-host").split(",")
TOP = 20
# actions that run on the controller only (no module run on a host)
CONTROLLER_ACTIONS = {
    f"ansible.builtin.{name}"
    for name in (
        "set_fact",
        "assert",
        "debug",
        "fail",
        "meta",
        "include_role",
        "include_tasks",
        "validate_argument_spec",
    )
}
CALLBACKS = REPO / "bench/callback_plugins"


def reference_tree(ref: str, into: Path) -> Path:
    """The commit's tree, with this checkout's wheelhouse cache (the same router sources and pins
    give the same wheelhouse, so its deploy installs nothing anew)."""
    tree = into / f"ref-{ref}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    (tree / ".cache").symlink_to((REPO / ".cache").resolve())
    (tree / ".venv").symlink_to(REPO / ".venv")
    return tree


def host_cpu_s(machines: list[str]) -> float:
    """CPU seconds the test hosts used so far: each runs in a cgroup of its own (tests/hosts/hosts.sh,
    kit-NAME), whose cpu.stat counts every process inside it (sshd, Ansible's modules, engines)."""
    total = 0.0
    for name in machines:
        stat = Path(f"/sys/fs/cgroup/unified/kit-{name}/cpu.stat").read_text()
        total += int(dict(line.split() for line in stat.splitlines())["usage_usec"]) / 1e6
    return total


def timed_deploy(tree: Path, inventory: Path, out: Path, machines: list[str]) -> dict:
    argv, env = playbook_command(
        inventory,
        "playbooks/deploy.yml",
        env={
            "ANSIBLE_CALLBACK_PLUGINS": str(CALLBACKS),
            # the variable replaces ansible.cfg's list: keep its epd_preload, so the deploy timed is the one
            # ansible.cfg runs (plugins/callback/epd_preload.py)
            "ANSIBLE_CALLBACKS_ENABLED": "epd.kit.epd_preload,epd_task_timer",
            "EPD_TASK_TIMER_OUT": str(out),
        },
    )
    argv[3] = str(tree / "playbooks/deploy.yml")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    hosts_before = host_cpu_s(machines)
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tree, env=env, check=False)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    controller_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    hosts_cpu = host_cpu_s(machines) - hosts_before  # the engines' and router's idle work is in it too
    if proc.returncode != 0:
        pytest.fail(f"re-deploy from {tree} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    timer = json.loads(out.read_text())
    changed = {host: r["changed"] for host, r in timer["recap"].items()}
    return {
        "wall_s": round(wall, 2),
        "controller_cpu_s": round(controller_cpu, 2),
        "hosts_cpu_s": round(hosts_cpu, 2),
        "load": round(load, 2),
        "changed": changed,
        "changed_tasks": [f"{t['task']} ({', '.join(t['changed'])})" for t in timer["tasks"] if t["changed"]],
        "tasks": timer["tasks"],
        "plays": timer["plays"],
        "task_count": len(timer["tasks"]),
        # a module run per host a task ran on (Python started on the host, or on the controller for a delegated one)
        "module_runs": sum(len(t["hosts"]) for t in timer["tasks"] if t["action"] not in CONTROLLER_ACTIONS),
        # a host whose `when:` was false: a worker forked on the controller, no module run
        "skipped_forks": sum(len(t.get("skipped", [])) for t in timer["tasks"]),
    }


def summary(runs: list[dict]) -> dict:
    per_task: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for task in run["tasks"]:
            per_task.setdefault((task["play"], task["task"]), []).append(task["seconds"])
    top = sorted(per_task.items(), key=lambda kv: -statistics.mean(kv[1]))[:TOP]
    return {
        "walls_s": [r["wall_s"] for r in runs],
        "median_s": round(statistics.median(r["wall_s"] for r in runs), 2),
        "cpu_s": [round(r["controller_cpu_s"] + r["hosts_cpu_s"], 1) for r in runs],
        "median_cpu_s": round(statistics.median(r["controller_cpu_s"] + r["hosts_cpu_s"] for r in runs), 2),
        "loads": [r["load"] for r in runs],
        "changed": [sum(r["changed"].values()) for r in runs],
        "changed_tasks": sorted({t for r in runs for t in r["changed_tasks"]}),
        "tasks_per_run": runs[-1]["task_count"],
        "module_runs": runs[-1]["module_runs"],
        "skipped_forks": runs[-1]["skipped_forks"],
        "top": [
            {"play": play, "task": task, "mean_s": round(statistics.mean(s), 2), "max_s": round(max(s), 2)}
            for (play, task), s in top
        ],
    }


def report(layout: str, results: dict[str, dict]) -> str:
    lines = [f"## {layout}"]
    for tree, s in results.items():
        lines.append(
            f"{tree}: median {s['median_s']} s over {s['walls_s']} (load {s['loads']}), CPU (controller + hosts) "
            f"median {s['median_cpu_s']} s over {s['cpu_s']}, changed={s['changed']}, "
            f"{s['tasks_per_run']} tasks, {s['module_runs']} module runs, {s['skipped_forks']} skipped forks"
            + (f"; changed: {s['changed_tasks']}" if s["changed_tasks"] else "")
        )
    if len(results) == 2:
        (a, sa), (b, sb) = results.items()
        lines.append(
            f"{b} / {a}: wall {sb['median_s'] / sa['median_s']:.2f}, CPU {sb['median_cpu_s'] / sa['median_cpu_s']:.2f}"
        )
    for tree, s in results.items():
        lines += [f"### top {TOP} tasks, {tree}", "| task | play | mean s | max s |", "|---|---|---|---|"]
        lines += [f"| {t['task']} | {t['play']} | {t['mean_s']} | {t['max_s']} |" for t in s["top"]]
    return "\n".join(lines)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_idempotent_redeploy(layout: str, host_pool: HostPool, tmp_path_factory) -> None:  # noqa: F811
    inventory = sandbox_inventory(layout, tmp_path_factory)
    stack = deploy_stack(host_pool, inventory, lambda *a, **k: None, layout, preinstalled=True)
    scratch = Path(tempfile.mkdtemp(prefix="epd-bench-deploy-", dir=tmp_path_factory.getbasetemp()))
    trees = {"this tree": REPO}
    if REF:
        trees = {REF: reference_tree(REF, scratch), "this tree": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    machines = [host.name for host in stack.hosts.values()]
    try:
        for i in range(RUNS):
            for name, tree in trees.items():
                out = scratch / f"{name.replace(' ', '-')}-{i}.json"
                runs[name].append(timed_deploy(tree, inventory, out, machines))
    finally:
        host_pool.down(*stack.hosts.values())
    results = {name: summary(r) for name, r in runs.items()}
    text = report(layout, results)
    print("\n" + text)
    out = Path(hosts_env()["KIT_DIR"]) / "bench-deploy-timer.json"
    figures = json.loads(out.read_text()) if out.exists() else {}
    figures[layout] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    out.write_text(json.dumps(figures, indent=1))
    (Path(hosts_env()["KIT_DIR"]) / f"bench-deploy-timer-{layout}.md").write_text(text + "\n")
    this = results["this tree"]
    assert this["changed"] == [0] * RUNS, f"{layout}: an idempotent re-deploy changed {this['changed_tasks']}"
