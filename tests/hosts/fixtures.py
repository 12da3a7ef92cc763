"""pytest fixtures for the real-systemd tier (loaded by tests/conftest.py).

    def test_x(test_hosts):             # session-scoped factory
        n1, n2 = test_hosts(2)          # hosts n1, n2 (booted once per session, reused)

    def test_y(host_pool):              # boot/reset/stop by hand
        n1 = host_pool.reset(host_pool.host(1))

Tests that use them are marked `@pytest.mark.systemd`. Outside `scripts/test.sh` (not
root, or not inside the kithub namespace) the fixtures FAIL with instructions: a tier
that cannot run is never skipped silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.hosts.harness import HostPool, TestHost, environment_problem, hosts_env
from tests.hosts.seed import seed_dir

HOW_TO_RUN = (
    "run this tier through the test command, which creates the namespace, boots the "
    "hosts and tears them down:  sudo scripts/test.sh tests/e2e  (see docs/sandbox.md)"
)


@pytest.fixture(scope="session")
def host_pool() -> Iterator[HostPool]:
    if os.environ.get("EPD_TEST_LANE") == "host-free":
        # scripts/test.sh runs this lane beside tests/e2e, which owns the hosts for the whole run
        pytest.fail(
            "a test outside tests/e2e asked for the test hosts: tests that use them live in tests/e2e", pytrace=False
        )
    problem = environment_problem()
    if problem:
        pytest.fail(f"real-systemd test hosts unavailable: {problem}; {HOW_TO_RUN}", pytrace=False)
    base = Path(hosts_env()["BASE"])
    if not (base / "lib/systemd/systemd").exists():
        pytest.fail(f"no test-host rootfs at {base}; {HOW_TO_RUN}", pytrace=False)
    pool = HostPool()
    try:
        pool.seed = seed_dir()
    except RuntimeError as exc:  # hosts still boot; tests that deploy call pool.require_model()
        pool.seed_problem = str(exc)
    yield pool
    pool.down()


@pytest.fixture(scope="session")
def test_hosts(host_pool: HostPool) -> Callable[[int], list[TestHost]]:
    """Factory: test_hosts(n) -> [n1..nn], booted on first use and shared by the session."""

    def hosts(count: int) -> list[TestHost]:
        if not 1 <= count <= 9:
            raise ValueError("test_hosts(n) serves n1..n9")
        return host_pool.ensure(count)

    return hosts
