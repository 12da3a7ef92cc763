"""Preflight on real hosts: a bound port and a missing model directory fail the deploy
before any unit or env file is written."""

from __future__ import annotations

import pytest

from tests.hosts.harness import REPO, ansible_playbook, copy_inventory

pytestmark = pytest.mark.systemd

ONE_HOST = REPO / "inventory/sandbox/one-host"


@pytest.fixture
def one_host(tmp_path):
    """inventory/sandbox/one-host on this lane's machine n1."""
    return copy_inventory(ONE_HOST, tmp_path / "inventory")


def assert_nothing_written(host) -> None:
    written = host.run("ls -d /etc/epd/engines/* /etc/systemd/system/epd* 2>/dev/null; true").stdout
    assert written.strip() == "", f"units/env files written before preflight failed: {written}"
    assert host.units("epd*") == []


def test_a_port_already_bound_fails_before_any_unit_is_written(host_pool, one_host):
    host_pool.require_model()
    (n1,) = host_pool.up(1)
    # something else already listens on PD-0's port (127.0.0.1:18100 in the one-host plan)
    n1.run("systemd-run --unit=port-squatter python3 -m http.server 18100 --bind 127.0.0.1")
    n1.run("for i in $(seq 50); do ss -Hltn | grep -q ':18100 ' && exit 0; sleep 0.1; done; exit 1")
    result = ansible_playbook(one_host, "playbooks/deploy.yml")
    assert result.returncode != 0, result.describe()
    assert "18100" in result.stdout + result.stderr, result.describe()
    assert_nothing_written(n1)


def test_a_missing_model_directory_fails_before_any_unit_is_written(host_pool, one_host):
    (n1,) = host_pool.up(1, seed=False)  # no /models/tiny-qwen3-vl on this host
    result = ansible_playbook(one_host, "playbooks/deploy.yml")
    assert result.returncode != 0, result.describe()
    assert "/models/tiny-qwen3-vl" in result.stdout + result.stderr, result.describe()
    assert_nothing_written(n1)
