"""The end-to-end tier's two lanes (tests/e2e/conftest.py LANE_B, tests/hosts/harness.py): lane b's
tests name hosts n1.. as always and run on other machines; nothing here boots a host."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import CONTINUES, FIRST, LANE_B
from tests.hosts.harness import (
    LANE_HOST_OFFSET,
    REPO,
    HostPool,
    copy_inventory,
    host_address,
    machine_address,
    relocated,
    write_inventory,
)

E2E = REPO / "tests/e2e"


@pytest.fixture
def lane_b(monkeypatch):
    monkeypatch.setenv("EPD_E2E_LANE", "b")


def test_lane_b_runs_host_n1_on_its_own_machine(lane_b):
    offset = LANE_HOST_OFFSET["b"]
    assert machine_address(1) == host_address(1 + offset) != host_address(1)
    pool = HostPool.__new__(HostPool)
    pool.env = {"SSH_KEY": "/k"}
    host = pool.host(1)
    assert (host.name, host.address) == (f"n{1 + offset}", machine_address(1))
    assert pool.index(host) == 1


def test_a_host_beyond_n9_is_refused_not_wrapped(lane_b):
    with pytest.raises(ValueError, match=r"would be n1[0-9]"):
        machine_address(9 - LANE_HOST_OFFSET["b"] + 1)


def test_an_unknown_lane_is_refused(monkeypatch):
    monkeypatch.setenv("EPD_E2E_LANE", "c")
    with pytest.raises(ValueError, match="EPD_E2E_LANE='c'"):
        machine_address(1)


def test_relocation_maps_host_addresses_only(lane_b):
    n1, n2 = machine_address(1), machine_address(2)
    text = "10.213.0.11 http://10.213.0.12:18100 10.213.0.1 10.213.0.100 10.213.0.21"
    assert relocated(text) == f"{n1} http://{n2}:18100 10.213.0.1 10.213.0.100 10.213.0.21"
    assert relocated({"a": ["10.213.0.11", 3]}) == {"a": [n1, 3]}


def test_lane_a_changes_nothing(monkeypatch):
    monkeypatch.delenv("EPD_E2E_LANE", raising=False)
    assert relocated("10.213.0.11") == "10.213.0.11" == machine_address(1)


def test_inventories_are_written_for_the_lane_and_a_rewrite_does_not_shift_twice(lane_b, tmp_path: Path):
    base = REPO / "inventory/sandbox/three-host"
    hosts_yml = yaml.safe_load((base / "hosts.yml").read_text())
    for _ in range(2):  # a Fleet writes its directory again after every change
        write_inventory(tmp_path / "fleet", base, hosts_yml, {"epd_router_listen_host": "10.213.0.13"})
        written = yaml.safe_load((tmp_path / "fleet/hosts.yml").read_text())
        assert written["all"]["children"]["epd_engines"]["hosts"]["n1"]["ansible_host"] == machine_address(1)
        extra = yaml.safe_load((tmp_path / "fleet/group_vars/all/zz-test.yml").read_text())
        assert extra == {"epd_router_listen_host": machine_address(3)}
    copied = copy_inventory(REPO / "inventory/sandbox/one-host", tmp_path / "one-host")
    assert machine_address(1) in (copied / "hosts.yml").read_text()
    assert "10.213.0.11" not in (copied / "hosts.yml").read_text()


def test_every_e2e_module_has_a_lane_and_a_continued_stack_stays_in_its_lane():
    modules = {path.stem for path in E2E.glob("test_*.py")}
    assert LANE_B.issubset(modules), f"LANE_B names modules that do not exist: {LANE_B - modules}"
    assert modules - LANE_B, "lane a would run nothing"
    assert set(FIRST) <= modules, f"FIRST names modules that do not exist: {set(FIRST) - modules}"
    for follower, leader in CONTINUES.items():
        assert (follower in LANE_B) == (leader in LANE_B), f"{follower} continues {leader}'s stack: one lane"
