"""Day-2 operations on three hosts, with bounded load through the router during every step,
every request counted: a fleet-wide PD change rolls the PDs in batches and nothing else; a
change on one host restarts no engine elsewhere; a removed PD drains before it stops; a second
deploy (as the sudo user kitops) changes nothing; batched vs one-at-a-time rolling restarts are
timed. Layout: n1 and n2 each run 1 VE + 2 PD, n3 the router. Tests run in file order on one
deployment, each step building on the last."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import LoadGenerator, Stack, is_healthy
from tests.hosts.harness import REPO, HostPool, PlaybookResult, ansible_playbook, write_inventory

# a deploy of six engines on a loaded 2-core machine takes minutes: more than the default budget
pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1200)]

BASE = REPO / "inventory/sandbox/three-host"
ENGINE_HOSTS = ("n1", "n2")
RATE_PER_S = 8
STEP_LIMIT_S = 600  # every step (deploy or rolling restart) ends well within this; the load stops with it


@dataclass
class Fleet:
    """The test's own inventory, derived from inventory/sandbox/three-host and rewritten per step."""

    directory: Path
    hosts_yml: dict
    group_vars: dict = field(default_factory=dict)

    def engine_host(self, name: str) -> dict:
        return self.hosts_yml["all"]["children"]["epd_engines"]["hosts"][name]

    def write(self) -> Path:
        return write_inventory(self.directory, BASE, self.hosts_yml, self.group_vars)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    hosts_yml = yaml.safe_load((BASE / "hosts.yml").read_text())
    fleet = Fleet(tmp_path_factory.mktemp("day2") / "inventory", hosts_yml)
    for name in ENGINE_HOSTS:
        fleet.engine_host(name).update({"epd_num_ve": 1, "epd_num_pd": 2, "epd_core_count": 32})
    fleet.write()
    return fleet


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, fleet: Fleet, record_timing) -> Iterator[Stack]:
    return deploy_stack(host_pool, fleet.directory, record_timing, "day 2 (2x 1 VE + 2 PD)")


def engine_pids(stack: Stack) -> dict[str, str]:
    """host/instance -> MainPID of every active engine."""
    pids = {}
    for name in ENGINE_HOSTS:
        host = stack.hosts[name]
        for unit in host.units("epd-engine@*"):
            state = host.show(unit, "ActiveState", "MainPID")
            if state["ActiveState"] == "active":
                pids[f"{name}/{unit.removeprefix('epd-engine@').removesuffix('.service')}"] = state["MainPID"]
    return pids


def restarted(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {engine for engine in before.keys() & after.keys() if before[engine] != after[engine]}


def under_load(stack: Stack, playbook: str, *args: str, inventory: Path | None = None) -> tuple[PlaybookResult, float]:
    """Run a playbook while bounded load goes through the router; no request may fail."""
    with LoadGenerator(
        stack.router_url,
        stack.model_id(),
        rate_per_s=RATE_PER_S,
        max_requests=RATE_PER_S * STEP_LIMIT_S,
        max_seconds=STEP_LIMIT_S,
    ) as load:
        time.sleep(2)
        start = time.monotonic()
        result = ansible_playbook(inventory or stack.inventory.directory, playbook, *args, timeout=STEP_LIMIT_S)
        elapsed = time.monotonic() - start
        time.sleep(2)
        outcome = load.stop()
    assert result.returncode == 0, result.describe()
    assert outcome.sent >= RATE_PER_S * 5, f"the load ran only {outcome.sent} requests"
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    return result, elapsed


def all_active_and_healthy(stack: Stack) -> None:
    for engine in stack.pools():
        assert is_healthy(engine) and engine["state"] == "active", engine


def test_a_pd_setting_fleet_wide_rolls_every_pd_in_batches_and_no_ve(stack, fleet, record_timing):
    before = engine_pids(stack)
    fleet.group_vars["epd_max_num_seqs"] = 4
    fleet.write()
    result, elapsed = under_load(stack, "playbooks/deploy.yml", "-e", "epd_rollout_batch_pd=2")
    record_timing("day 2: deploy rolling a PD setting (4 PDs, batches of 2)", elapsed)
    # the change reaches the compiled graphs (max_num_seqs): one canary for the PD configuration
    # first, alone, then batches of 2 (docs/operations.md "Compile cache")
    assert "4 engines in 3 batches" in result.stdout, result.describe()
    assert "batch 1/3 PD canary: epd-n1-pd-0 (n1, compiles)" in result.stdout, result.describe()
    assert "batch 2/3 PD: epd-n2-pd-0 (n2, compiles), epd-n1-pd-1 (n1, local hit)" in result.stdout, result.describe()
    after = engine_pids(stack)
    assert restarted(before, after) == {"n1/pd-0", "n1/pd-1", "n2/pd-0", "n2/pd-1"}
    assert (
        "--max-num-seqs 4"
        in stack.hosts["n2"]
        .run("tr '\\0' ' ' < /proc/$(systemctl show -pMainPID --value epd-engine@pd-1)/cmdline")
        .stdout
    )
    all_active_and_healthy(stack)


def test_a_change_on_one_host_restarts_no_engine_on_another(stack, fleet):
    before = engine_pids(stack)
    fleet.engine_host("n2")["epd_excluded_cores"] = [0, 1, 2, 3]  # every n2 engine moves to other cores
    fleet.write()
    under_load(stack, "playbooks/deploy.yml")
    after = engine_pids(stack)
    assert restarted(before, after) == {"n2/ve-0", "n2/pd-0", "n2/pd-1"}
    all_active_and_healthy(stack)


def test_a_removed_pd_drains_before_it_stops_and_no_other_host_restarts(stack, fleet):
    before = engine_pids(stack)
    fleet.engine_host("n1")["epd_num_pd"] = 1
    fleet.write()
    result, _ = under_load(stack, "playbooks/deploy.yml")
    after = engine_pids(stack)
    assert "n1/pd-1" not in after and stack.hosts["n1"].is_active("epd-engine@pd-1.service") != "active"
    assert not stack.hosts["n1"].path("/etc/epd/engines/pd-1.env").exists()
    assert not {e for e in restarted(before, after) if e.startswith("n2/")}, (before, after)
    assert "n1/pd-0" not in restarted(before, after)
    assert "epd-n1-pd-1" not in {e["id"] for e in stack.pools()}
    assert "TASK [Wait until the router has no request in flight on them]" in result.stdout, result.describe()
    all_active_and_healthy(stack)


def test_a_second_deploy_as_the_sudo_user_changes_nothing(stack, fleet):
    before = engine_pids(stack)
    router_before = stack.hosts["n3"].show("epd-router@0.service", "MainPID")
    result, _ = under_load(stack, "playbooks/deploy.yml", "-e", "ansible_user=kitops")
    for host in stack.hosts:
        assert result.recap[host]["changed"] == 0, result.describe()
    assert engine_pids(stack) == before
    assert stack.hosts["n3"].show("epd-router@0.service", "MainPID") == router_before
    # the run logged in as kitops and became root through sudo
    assert "kitops" in stack.hosts["n1"].run("journalctl -q --no-pager -t sudo", check=False).stdout


def test_batched_rolling_restart_vs_one_at_a_time(stack, record_timing):
    timings = {}
    for label, args in (
        ("one at a time", ()),
        ("PD batches of 2, VE batches of 1", ("-e", "epd_rollout_batch_pd=2")),
    ):
        before = engine_pids(stack)
        _, elapsed = under_load(stack, "playbooks/rolling_restart.yml", *args)
        assert restarted(before, engine_pids(stack)) == set(before), label
        timings[label] = elapsed
        record_timing(f"day 2: rolling restart of 5 engines, {label}", elapsed)
    all_active_and_healthy(stack)
    print("rolling restart durations:", timings)
