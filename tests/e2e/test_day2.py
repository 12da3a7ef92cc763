"""Day-2 operations on four hosts, with bounded load through the router during every step,
every request counted: a fleet-wide PD change rolls the PDs in batches (across hosts) and
nothing else; the Neuron release rolls to 2.33 and back, canaries first;
in one deploy, a change on one host restarts no engine elsewhere, a PD removed
from another drains before it stops and a host removed from the fleet (n4) drains and loses its
access to the VEs' side channels (docs/security.md "Who can reach what"); a second deploy (as the
sudo user kitops) changes nothing on any host. Layout: the four-host fleet (tests/e2e/stack.py):
n1 2 VE, n2 2 PD, n4 1 PD, n3 the router. In a full run this module continues on the fleet
test_three_hosts ends with (conftest: shared stacks), otherwise it deploys it. Tests run in file
order on one deployment, each step building on the last.

How long batched and one-at-a-time rolling restarts take is a measurement, not a test: it lives
in bench/rollout_batches.py (docs/benchmarks.md "Rollout batches")."""

from __future__ import annotations

import pytest

from tests.e2e.access import nft_set
from tests.e2e.conftest import FOUR_HOSTS, SharedStacks, deploy_stack
from tests.e2e.stack import (
    Fleet,
    Stack,
    engine_pids,
    four_host_fleet,
    is_healthy,
    restarted,
    under_load,
    why_restarted,
)
from tests.hosts.harness import HostPool
from tests.hosts.sandbox import SandboxInventory

# a deploy of five engines on a loaded 2-core machine takes minutes: more than the default budget
pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    return four_host_fleet(tmp_path_factory.mktemp("day2") / "inventory")


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, shared_stacks: SharedStacks, fleet: Fleet, record_timing) -> Stack:
    shared = shared_stacks.take(FOUR_HOSTS)
    if shared is not None:  # the same fleet, deployed by test_three_hosts: continue on it
        return Stack(SandboxInventory.load(fleet.directory), shared.hosts)
    return deploy_stack(host_pool, fleet.directory, record_timing, "day 2 (four hosts)")


def all_active_and_healthy(stack: Stack) -> None:
    for engine in stack.pools():
        assert is_healthy(engine) and engine["state"] == "active", engine


def test_a_pd_setting_fleet_wide_rolls_every_pd_in_batches_and_no_ve(stack, fleet, record_timing):
    before = engine_pids(stack)
    fleet.group_vars["epd_max_num_seqs"] = 4
    fleet.write()
    result, elapsed = under_load(stack, "playbooks/deploy.yml", "-e", "epd_rollout_batch_pd=2")
    record_timing("day 2: deploy rolling a PD setting (3 PDs, batches of 2)", elapsed)
    # the change reaches the compiled graphs (max_num_seqs): one canary for the PD configuration
    # first, alone, then batches of 2 that take the PDs in turns over their hosts
    # (docs/operations.md "Compile cache")
    assert "3 engines in 2 batches" in result.stdout, result.describe()
    assert "batch 1/2 PD canary: epd-n2-pd-0 (n2, compiles)" in result.stdout, result.describe()
    assert "batch 2/2 PD: epd-n4-pd-0 (n4, compiles), epd-n2-pd-1 (n2, local hit)" in result.stdout, result.describe()
    after = engine_pids(stack)
    assert restarted(before, after) == {"n2/pd-0", "n2/pd-1", "n4/pd-0"}
    assert "--max-num-seqs 4" in " ".join(stack.hosts["n2"].main_process("epd-engine@pd-1")[1])
    all_active_and_healthy(stack)


def test_the_neuron_release_rolls_to_2_33_under_load_and_back(stack, fleet, record_timing):
    """epd_neuron_release 2.32.0 -> 2.33.0 and back is a rolling change (docs/operations.md "Upgrading
    the Neuron release"): every engine's environment follows the release (VLLM_NEURON_BACKEND for
    2.33's Precompile Cache, the sim's vLLM), so each deploy rolls all five engines, one canary per
    configuration first, both pools' together; 2.33's canaries compile (its compiler's keys are
    new), and no request fails either way."""
    for release, vllm, backend in (("2.33.0", "0.29", "VLLM_NEURON_BACKEND='neuron_native'"), ("2.32.0", "0.24", None)):
        before = engine_pids(stack)
        fleet.group_vars["epd_neuron_release"] = release
        fleet.write()
        result, elapsed = under_load(stack, "playbooks/deploy.yml", "--tags", "engines", "-e", "epd_rollout_batch_pd=2")
        record_timing(f"day 2: deploy --tags engines rolling the Neuron release to {release} (5 engines)", elapsed)
        assert "5 engines in 3 batches" in result.stdout, result.describe()
        canary = "batch 1/3 PD+VE canary: epd-n2-pd-0 (n2, compiles), epd-n1-ve-0 (n1, compiles)"
        assert canary in result.stdout, result.describe()
        assert restarted(before, engine_pids(stack)) == set(before), why_restarted(stack, set(before))
        env = stack.hosts["n2"].run("cat /etc/epd/engines/pd-0.env").stdout
        assert f"EPD_SIM_VLLM='{vllm}'" in env and (backend in env if backend else "VLLM_NEURON_BACKEND" not in env)
        journal = stack.hosts["n4"].journal("epd-engine@pd-0.service", lines=400)
        assert f"answering as vLLM {vllm} (EPD_SIM_VLLM)" in journal.rsplit("vLLM API server version", 1)[-1]
        all_active_and_healthy(stack)
    del fleet.group_vars["epd_neuron_release"]  # the default, as before
    fleet.write()


def test_a_change_on_one_host_restarts_no_engine_on_another_and_a_removed_pd_drains_before_it_stops(stack, fleet):
    """One deploy, three changes on three hosts (as an operator batches them): n1's VEs move to other
    cores, so they restart and nothing else does; n2 loses a PD, which the routers drain before it
    stops and whose files go, while n2's other PD runs on; n4 leaves the fleet: its PD is drained
    and only then do the VEs' side channels close to it (the last play, the plan's rules alone)."""
    before = engine_pids(stack)
    n2, n4 = stack.hosts["n2"].address, stack.hosts["n4"].address
    assert nft_set(stack.hosts["n1"], "side_channel_v4") == sorted([n2, n4])
    fleet.engine_host("n1")["epd_excluded_cores"] = [0, 1, 2, 3]
    fleet.engine_host("n2")["epd_num_pd"] = 1
    del fleet.hosts_yml["all"]["children"]["epd_engines"]["hosts"]["n4"]
    fleet.write()
    result, _ = under_load(stack, "playbooks/deploy.yml")
    assert nft_set(stack.hosts["n1"], "side_channel_v4") == [n2]
    assert "epd-n4-pd-0" not in {e["id"] for e in stack.pools()}
    after = engine_pids(stack)
    moved = restarted(before, after)
    unplanned = {engine for engine in moved if not engine.startswith("n1/")}
    assert "n1/ve-0" in moved and not unplanned, f"{moved}\n{why_restarted(stack, unplanned)}"
    assert "n2/pd-1" not in after and stack.hosts["n2"].is_active("epd-engine@pd-1.service") != "active"
    assert not stack.hosts["n2"].path("/etc/epd/engines/pd-1.env").exists()
    assert "epd-n2-pd-1" not in {e["id"] for e in stack.pools()}
    assert "TASK [Wait until the router has no request in flight on them]" in result.stdout, result.describe()
    all_active_and_healthy(stack)


def test_a_second_deploy_as_the_sudo_user_changes_nothing(stack, fleet, record_timing):
    before = engine_pids(stack)
    router_before = stack.hosts["n3"].show("epd-router@0.service", "MainPID")
    result, elapsed = under_load(stack, "playbooks/deploy.yml", "-e", "ansible_user=kitops")
    record_timing("day 2: idempotent re-deploy, 4 hosts (as the sudo user, under load)", elapsed)
    for host in SandboxInventory.load(fleet.directory).hosts:  # n4 left the fleet in the step before
        assert result.recap[host]["changed"] == 0, result.describe()
    assert engine_pids(stack) == before
    assert stack.hosts["n3"].show("epd-router@0.service", "MainPID") == router_before
    # the run logged in as kitops and became root through sudo
    assert "kitops" in stack.hosts["n1"].run("journalctl -q --no-pager -t sudo", check=False).stdout
