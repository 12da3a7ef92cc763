"""End-to-end fixtures: a freshly booted and deployed sandbox stack per test module.

Timings of the expensive steps (host boot, first deploy, re-deploy, rolling restart) are
collected with `record_timing` and printed at the end of the run (docs/sandbox.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack
from tests.hosts.harness import REPO, HostPool, ansible_playbook, hosts_env
from tests.hosts.sandbox import SandboxInventory

TIMINGS = pytest.StashKey[dict[str, float]]()
DEPLOY = "playbooks/deploy.yml"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TIMINGS] = {}


@pytest.fixture(scope="session")
def record_timing(pytestconfig: pytest.Config) -> Callable[[str, float], None]:
    def record(name: str, seconds: float) -> None:
        pytestconfig.stash[TIMINGS][name] = round(seconds, 1)

    return record


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    timings = config.stash.get(TIMINGS, {})
    if not timings:
        return
    terminalreporter.section("sandbox timings")
    for name, seconds in timings.items():
        terminalreporter.write_line(f"{name:<40} {seconds:7.1f} s")
    try:
        out = Path(hosts_env()["KIT_DIR"]) / "e2e-timings.json"
        out.write_text(json.dumps(timings, indent=2))
    except Exception:
        pass


def deploy_stack(pool: HostPool, inventory_dir: Path, record: Callable[[str, float], None], label: str) -> Stack:
    if not (REPO / DEPLOY).exists():
        pytest.fail(f"{DEPLOY} does not exist yet: the end-to-end tier cannot deploy", pytrace=False)
    pool.require_model()
    inventory = SandboxInventory.load(inventory_dir)
    indexes = [int(name[1:]) for name in inventory.hosts]
    start = time.monotonic()
    booted = pool.up(*indexes)
    record(f"{label}: boot {len(booted)} fresh host(s)", time.monotonic() - start)
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
