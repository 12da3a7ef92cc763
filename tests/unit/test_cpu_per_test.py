"""tests/hosts/cpu_per_test.py: each test's CPU-s from its lane's cgroup, into the JUnit report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.hosts import cpu_per_test

pytest_plugins = ["pytester"]


def cgroup_v1(tmp_path: Path, path: str, usage_ns: int) -> tuple[Path, Path]:
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"4:memory:/x\n2:cpuacct,cpu:{path}\n0::/\n")
    counter = tmp_path / "fs/cpuacct,cpu" / path.lstrip("/") / "cpuacct.usage"
    counter.parent.mkdir(parents=True)
    counter.write_text(f"{usage_ns}\n")
    return proc, counter


def test_the_lanes_counter_is_its_own_cgroups_not_the_machines(tmp_path: Path):
    proc, counter = cgroup_v1(tmp_path, "/epd-test-7/e2e-a", 2_500_000_000)
    assert cpu_per_test.lane_counter(str(proc), tmp_path / "fs") == counter
    assert cpu_per_test.read_ns(counter) == 2_500_000_000
    # in the root cgroup the counter is the whole machine's: no figure rather than a wrong one
    (tmp_path / "root-cgroup").write_text("2:cpuacct,cpu:/\n0::/\n")
    assert cpu_per_test.lane_counter(str(tmp_path / "root-cgroup"), tmp_path / "fs") is None
    assert cpu_per_test.lane_counter(str(tmp_path / "absent"), tmp_path / "fs") is None


def test_cgroup_v2s_usage_is_read_from_cpu_stat(tmp_path: Path):
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/epd-test-7/host-free\n")
    stat = tmp_path / "fs/epd-test-7/host-free/cpu.stat"
    stat.parent.mkdir(parents=True)
    stat.write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    assert cpu_per_test.lane_counter(str(proc), tmp_path / "fs") == stat
    assert cpu_per_test.read_ns(stat) == 1_500_000_000


def test_each_test_gets_the_growth_of_the_counter_from_setup_to_teardown(pytester: pytest.Pytester, tmp_path: Path):
    _, counter = cgroup_v1(tmp_path, "/lane", 10_000_000_000)
    # the test itself stands in for the lane's work: it moves the counter by 3.25 s and 0.5 s
    pytester.makepyfile(
        f"""
        import pytest
        from pathlib import Path
        COUNTER = Path({str(counter)!r})

        @pytest.fixture
        def busy():
            yield
            COUNTER.write_text(str(int(COUNTER.read_text()) + 250_000_000))  # in teardown: counted

        def test_heavy(busy):
            COUNTER.write_text(str(int(COUNTER.read_text()) + 3_000_000_000))

        def test_light():
            COUNTER.write_text(str(int(COUNTER.read_text()) + 500_000_000))
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    report = tmp_path / "lane.xml"
    result = pytester.runpytest_inprocess(
        f"--junitxml={report}", "-p", "no:cacheprovider", plugins=[cpu_per_test.CpuPerTest(counter)]
    )
    result.assert_outcomes(passed=2)
    figures = {
        case.get("name"): [p.get("value") for p in case.iter("property") if p.get("name") == "cpu_s"]
        for case in ET.parse(report).getroot().iter("testcase")
    }
    assert figures == {"test_heavy": ["3.2"], "test_light": ["0.5"]}
