"""End-to-end fixtures: a freshly booted and deployed sandbox stack per test module, except
where a module continues on the stack the one before it leaves (`shared_stacks`: test_day2
takes over the four-host fleet test_three_hosts ends with, saving a boot and a first deploy;
`CONTINUES` runs it right after). Run alone, such a module deploys its own stack.

Timings of the expensive steps (host boot, first deploy, re-deploy, rolling restart) are
collected with `record_timing` and printed at the end of the run (docs/sandbox.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack
from tests.hosts.harness import REPO, HostPool, TestHost, ansible_playbook, hosts_env
from tests.hosts.sandbox import SandboxInventory

TIMINGS = pytest.StashKey[dict[str, tuple[float, str]]]()  # name -> (value, unit)
DEPLOY = "playbooks/deploy.yml"
# module -> the module whose deployed stack it continues on (it runs right after that one)
CONTINUES = {"test_day2": "test_three_hosts"}
FOUR_HOSTS = "four hosts"  # the stack test_three_hosts leaves for test_day2


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TIMINGS] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection order, except that a module in CONTINUES runs right after the one it continues."""
    here = Path(__file__).parent
    files = list(dict.fromkeys(item.path for item in items))
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
        self._kept[name] = (stack, self.pool.generation(stack.hosts))

    def take(self, name: str) -> Stack | None:
        stack, generation = self._kept.pop(name, (None, ()))
        if stack is None or self.pool.generation(stack.hosts) != generation:
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
    try:
        out = Path(hosts_env()["KIT_DIR"]) / "e2e-timings.json"
        out.write_text(
            json.dumps({name: {"value": value, "unit": unit} for name, (value, unit) in timings.items()}, indent=2)
        )
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
) -> Stack:
    """Boot the inventory's hosts fresh and deploy it. shared=(DIR, PATH): every host sees the
    controller's DIR at PATH (HostPool.up); prepare(hosts) runs between the boot and the deploy."""
    if not (REPO / DEPLOY).exists():
        pytest.fail(f"{DEPLOY} does not exist yet: the end-to-end tier cannot deploy", pytrace=False)
    pool.require_model()
    inventory = SandboxInventory.load(inventory_dir)
    indexes = [int(name[1:]) for name in inventory.hosts]
    start = time.monotonic()
    booted = pool.up(*indexes, shared=shared)
    record(f"{label}: boot {len(booted)} fresh host(s)", time.monotonic() - start)
    if prepare is not None:
        prepare({h.name: h for h in booted})
    start = time.monotonic()
    result = ansible_playbook(inventory.directory, DEPLOY)
    record(f"{label}: first deploy", time.monotonic() - start)
    if result.returncode != 0:
        pytest.fail(f"first deploy of {inventory_dir} failed:\n{result.describe()}", pytrace=False)
    stack = Stack(inventory, {h.name: h for h in booted})
    stack.wait_ready(timeout=60)
    return stack


@pytest.fixture(scope="module")
def one_host_stack(host_pool: HostPool, record_timing) -> Iterator[Stack]:
    return deploy_stack(host_pool, REPO / "inventory/sandbox/one-host", record_timing, "1 host")


@pytest.fixture(scope="module")
def three_host_stack(host_pool: HostPool, record_timing) -> Iterator[Stack]:
    return deploy_stack(host_pool, REPO / "inventory/sandbox/three-host", record_timing, "3 hosts")
