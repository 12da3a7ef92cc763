"""The controller at fleet scale (docs/benchmarks.md "Controller at fleet scale"): the wall-clock and
CPU time of plan.yml, render.yml and the controller part of deploy.yml on a generated inventory of
N hosts (every fourth host 1 VE + 6 PD, the others 8 PD; the router on the first host).

    .venv/bin/python -m bench.controller_scale                         # 16, 64 and 256 hosts
    .venv/bin/python -m bench.controller_scale --hosts 16 64 --playbooks render
    git worktree add --detach /tmp/epd-before <rev>                    # a kit to compare with
    .venv/bin/python -m bench.controller_scale --kit before=/tmp/epd-before --kit after=.

No host is contacted, and the hosts' addresses (10.213.x.y, ansible_host and epd_bind_address)
are never used: plan.yml runs on localhost; render.yml's play has connection local and no facts
and its tasks run on the controller only (the render action needs no connection), as an operator
runs it against a real inventory; deploy.yml is run with --limit localhost, so its first play
(the controller preflight: the inventory check and the plan, everything before the first host
task) runs and every later play matches no host. Each kit runs its own planner (PYTHONPATH) and
its own playbooks; the kits alternate per size and playbook so they share the machine's load.
CPU is the user+sys time of ansible-playbook and its workers, the figure a loaded machine
disturbs least. Results go to bench/results/controller_scale.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.common import REPO, RunRecord

PLAYBOOKS = {
    "plan": ["playbooks/plan.yml"],
    "render": ["playbooks/render.yml", "-e", "render_dir={out}"],
    "deploy-controller": ["playbooks/deploy.yml", "--limit", "localhost"],
}
FLEET_SETTINGS = {  # the multi-node example's pool settings
    "epd_model": "/models/Qwen3-VL-32B-Instruct",
    "epd_engine_backend": "vllm",
    "epd_ve_tp": 4,
    "epd_ve_dp": 4,
    "epd_pd_tp": 8,
    "epd_max_model_len": 8192,
    "epd_max_num_seqs": 8,
}
TIMEOUT_S = 1800  # a run past it is recorded as not finished (None), the next one starts


@dataclass(frozen=True)
class Timing:
    kit: str
    playbook: str
    hosts: int
    wall_s: float | None  # None: not finished within --timeout
    cpu_s: float | None


def write_inventory(directory: Path, hosts: int, kit: Path) -> Path:
    """N engine hosts in 10.213.0.0/16 (never contacted), the router on the first; localhost."""
    engines = {}
    for index in range(hosts):
        address = f"10.213.{index // 250}.{index % 250 + 1}"
        counts = {"epd_num_ve": 1, "epd_num_pd": 6} if index % 4 == 0 else {"epd_num_pd": 8}
        engines[f"trn2-{index:03d}"] = {"ansible_host": address, "epd_bind_address": address, **counts}
    inventory = {
        "all": {
            # named so that deploy.yml's --limit can keep it (an implicit localhost matches no limit)
            "hosts": {"localhost": {"ansible_connection": "local"}},
            "children": {"epd_engines": {"hosts": engines}, "epd_router": {"hosts": {"trn2-000": None}}},
        }
    }
    settings = dict(FLEET_SETTINGS)
    if "epd_client_networks" in (kit / "router/epd_kit/plan/variables.py").read_text():
        settings["epd_client_networks"] = ["10.213.0.0/16"]  # a kit with the fleet firewall wants them named
    (directory / "group_vars" / "all").mkdir(parents=True, exist_ok=True)
    (directory / "hosts.yml").write_text(yaml.safe_dump(inventory, sort_keys=False))
    (directory / "group_vars" / "all" / "epd.yml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return directory


def kit_env(kit: Path) -> dict[str, str]:
    """Run the kit's own playbooks and planner: its collection link and its router/ first."""
    link = kit / ".collections" / "ansible_collections" / "epd" / "kit"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("../../..")
    return {**os.environ, "PYTHONPATH": str(kit / "router"), "ANSIBLE_CONFIG": str(kit / "ansible.cfg")}


def run(kit_name: str, kit: Path, playbook: str, inventory: Path, hosts: int, work: Path, timeout_s: float) -> Timing:
    out = work / f"render-{kit_name}-{hosts}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory)]
    argv += [part.format(out=out) for part in PLAYBOOKS[playbook]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    process = subprocess.Popen(
        argv,
        cwd=kit,
        env=kit_env(kit),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # ansible-playbook and its workers
        process.communicate()
        return Timing(kit_name, playbook, hosts, None, None)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode != 0:
        raise SystemExit(f"{kit_name} {playbook} at {hosts} hosts failed:\n{output[-4000:]}")
    if playbook == "render":
        rendered = sorted(path.name for path in out.iterdir())
        assert len(rendered) == hosts, f"render wrote {len(rendered)} host directories, not {hosts}"
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(kit_name, playbook, hosts, round(wall, 1), round(cpu, 1))


def table(timings: list[Timing], sizes: list[int]) -> list[str]:
    """One Markdown row per playbook and kit: wall (CPU) seconds per fleet size."""
    lines = ["| playbook | kit | " + " | ".join(f"{n} hosts" for n in sizes) + " |"]
    lines.append("|---|---|" + "---:|" * len(sizes))
    rows: dict[tuple[str, str], dict[int, Timing]] = {}
    for timing in timings:
        rows.setdefault((timing.playbook, timing.kit), {})[timing.hosts] = timing
    for (playbook, kit), by_size in rows.items():
        cells = [_cell(by_size[n]) if n in by_size else "" for n in sizes]
        lines.append(f"| {playbook} | {kit} | " + " | ".join(cells) + " |")
    return lines


def _cell(timing: Timing) -> str:
    return "did not finish" if timing.wall_s is None else f"{timing.wall_s} s ({timing.cpu_s} s CPU)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--playbooks", nargs="+", choices=list(PLAYBOOKS), default=list(PLAYBOOKS))
    parser.add_argument("--kit", action="append", default=[], metavar="NAME=DIR", help="a kit checkout (default: here)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds one playbook run may take")
    args = parser.parse_args()
    assert all(1 <= n <= 1000 for n in args.hosts), "--hosts: 1..1000"
    kits = {name: Path(path).resolve() for name, _, path in (kit.partition("=") for kit in args.kit)}
    kits = kits or {"this": REPO}
    record = RunRecord.start("controller_scale")
    timings: list[Timing] = []
    with tempfile.TemporaryDirectory(prefix="epd-controller-scale-") as tmp:
        work = Path(tmp)
        for hosts in args.hosts:
            for playbook in args.playbooks:
                for name, kit in kits.items():
                    inventory = write_inventory(work / f"inventory-{name}-{hosts}", hosts, kit)
                    timings.append(run(name, kit, playbook, inventory, hosts, work, args.timeout))
                    print(timings[-1], flush=True)
    lines = table(timings, args.hosts)
    print("\n".join(lines))
    record.results = {"timings": timings, "table": lines, "kits": {name: str(kit) for name, kit in kits.items()}}
    print(f"saved {record.save()}")


if __name__ == "__main__":
    main()
