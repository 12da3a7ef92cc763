"""The end-to-end tier's two lanes (tests/e2e/conftest.py LANE_B, tests/hosts/harness.py): lane b's
tests name hosts n1.. as always and run on other machines; nothing here boots a host."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import CONTINUES, FIRST, LANE_B, LAST
from tests.hosts import durations
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


def test_the_docs_e2e_table_names_the_lane_each_module_runs_in():
    """docs/sandbox.md "The end-to-end tests": a row per module, its lane cell `a` or `b` as LANE_B
    says, the FIRST modules' places, the LAST ones' `last`, a CONTINUES follower `right after` its
    leader."""
    text = (REPO / "docs/sandbox.md").read_text()
    table = text.split("## The end-to-end tests", 1)[1].split("\n\n", 2)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `test_")]
    lanes = {row[0].split("`")[1].removesuffix(".py"): row[1] for row in rows}
    assert set(lanes) == {path.stem for path in E2E.glob("test_*.py")}, "a row per module, no other"
    for module, cell in lanes.items():
        assert cell.split(",")[0].split()[0] == ("b" if module in LANE_B else "a"), (module, cell)
    for place, module in zip(("first", "second"), FIRST, strict=True):
        assert place in lanes[module], (module, lanes[module])
    for module in LAST:
        assert "last" in lanes[module], (module, lanes[module])
    for follower, leader in CONTINUES.items():
        assert f"right after {leader}" in lanes[follower], (follower, lanes[follower])


def junit(path: Path, cases: list[tuple[str, str, float]], cpu: dict[str, float] | None = None) -> None:
    """A JUnit report as pytest writes one (--junitxml): a testsuite of testcases with their time,
    and where `cpu` names a test, its `cpu_s` property (tests/hosts/cpu_per_test.py)."""
    cpu = cpu or {}

    def properties(name: str) -> str:
        return f'<properties><property name="cpu_s" value="{cpu[name]}"/></properties>' if name in cpu else ""

    rows = "".join(f'<testcase classname="{c}" name="{n}" time="{t}">{properties(n)}</testcase>' for c, n, t in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')


def test_the_runs_durations_sum_each_lanes_modules_and_list_the_slowest_tests(tmp_path: Path):
    junit(
        tmp_path / "e2e-a.xml",
        [
            ("tests.e2e.test_one_host", "test_deploy", 226.6),
            ("tests.e2e.test_one_host", "test_teardown", 43.1),
            ("tests.e2e.test_two_models", "test_each_model", 33.6),
        ],
    )
    junit(tmp_path / "e2e-b.xml", [("tests.e2e.test_day2", "test_roll", 138.8), ("tests.e2e.test_day2", "test_x", 1.2)])
    junit(
        tmp_path / "host-free.xml",
        [("tests.unit.test_wire.TestFrames", "test_a", 0.5), ("tests.unit.test_wire", "test_b", 0.25)],
    )
    (tmp_path / "real-engines.xml").write_text("<testsuites><testsuite")  # a lane stopped mid-write
    cases = durations.read_reports(tmp_path)
    assert len(cases) == 7
    totals = durations.module_totals(cases)
    assert list(totals) == ["e2e-a", "e2e-b", "host-free"]
    assert [(m.module, round(m.seconds, 1), m.tests) for m in totals["e2e-a"]] == [
        ("tests.e2e.test_one_host", 269.7, 2),
        ("tests.e2e.test_two_models", 33.6, 1),
    ]
    assert [(m.module, m.seconds, m.tests) for m in totals["e2e-b"]] == [("tests.e2e.test_day2", 140.0, 2)]
    # a class's tests count to their module
    assert [(m.module, m.seconds, m.tests) for m in totals["host-free"]] == [("tests.unit.test_wire", 0.75, 2)]
    lines = durations.summary(cases, slowest=2)
    assert lines[1:3] == [
        "      226.6s       ? CPU-s  e2e-a      tests.e2e.test_one_host::test_deploy",
        "      138.8s       ? CPU-s  e2e-b      tests.e2e.test_day2::test_roll",
    ]
    assert lines[3] == "   (7 tests, 444 s in all)"
    assert not any(line.startswith("== most CPU") for line in lines)  # no lane measured its CPU
    assert "      303.3s       ? CPU-s  e2e-a      = the lane: 3 tests in 2 modules" in lines
    assert "      269.7s       ? CPU-s  e2e-a      tests.e2e.test_one_host (2 tests)" in lines
    assert "      140.0s       ? CPU-s  e2e-b      tests.e2e.test_day2 (2 tests)" in lines


def test_the_tests_that_cost_the_most_cpu_are_listed_beside_the_slowest(tmp_path: Path):
    junit(
        tmp_path / "e2e-a.xml",
        [("tests.e2e.test_one_host", "test_deploy", 226.6), ("tests.e2e.test_one_host", "test_x", 40.0)],
        cpu={"test_deploy": 95.5, "test_x": 61.2},
    )
    junit(tmp_path / "host-free.xml", [("tests.unit.test_wire", "test_b", 90.0)])  # not measured
    lines = durations.summary(durations.read_reports(tmp_path), slowest=2)
    assert lines[1:3] == [
        "      226.6s    95.5 CPU-s  e2e-a      tests.e2e.test_one_host::test_deploy",
        "       90.0s       ? CPU-s  host-free  tests.unit.test_wire::test_b",
    ]
    most = lines.index("== most CPU: 2 tests (their lane's cgroup from setup to teardown, test hosts included)")
    assert lines[most + 1 : most + 4] == [
        "      226.6s    95.5 CPU-s  e2e-a      tests.e2e.test_one_host::test_deploy",
        "       40.0s    61.2 CPU-s  e2e-a      tests.e2e.test_one_host::test_x",
        "   (2 tests measured, 157 CPU-s in all)",
    ]
    assert "      266.6s   156.7 CPU-s  e2e-a      = the lane: 2 tests in 1 modules" in lines
    assert "       90.0s       ? CPU-s  host-free  = the lane: 1 tests in 1 modules" in lines


def test_a_background_lanes_many_modules_are_cut_to_the_longest_and_the_rest_summed(tmp_path: Path):
    junit(tmp_path / "host-free.xml", [(f"tests.unit.test_m{i}", "test_a", float(i)) for i in range(1, 6)])
    lines = durations.summary(durations.read_reports(tmp_path), modules_per_lane=2)
    modules = lines.index("== modules per lane (setup + call + teardown summed; a lane's tests run one after another)")
    lanes = lines[modules + 1 :]
    assert lanes == [
        "       15.0s       ? CPU-s  host-free  = the lane: 5 tests in 5 modules",
        "        5.0s       ? CPU-s  host-free  tests.unit.test_m5 (1 tests)",
        "        4.0s       ? CPU-s  host-free  tests.unit.test_m4 (1 tests)",
        "        6.0s       ? CPU-s  host-free  (3 more modules)",
    ]


def test_the_durations_script_refuses_a_missing_directory(tmp_path: Path, capsys):
    assert durations.main([str(tmp_path / "nothing")]) == 2
    assert "usage: durations.py DIR" in capsys.readouterr().err
    assert durations.main([str(tmp_path)]) == 0  # an empty directory: a run that wrote no report yet
    assert "(0 tests, 0 s in all)" in capsys.readouterr().out
