"""Each test's CPU-s, for the full run's summary (tests/hosts/durations.py): scripts/test.sh runs
every lane in a cgroup of its own, and a lane's tests run one after another, so the growth of the
lane cgroup's CPU counter across a test (setup to teardown) is what that test cost the machine,
the test hosts and engines it keeps busy included. The run is CPU-bound (docs/sandbox.md "Where the
CPU goes"), so this is the figure to cut, where a test's seconds also count its neighbours' load.

The figure goes into the JUnit report as the test's `cpu_s` property. Outside a lane cgroup (a
process in the root cgroup would read the whole machine's counter) nothing is recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

CGROUP_ROOT = Path("/sys/fs/cgroup")
_START = pytest.StashKey[int]()


def lane_counter(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> Path | None:
    """The CPU counter of this process's own cgroup: cgroup v1's cpuacct.usage (ns) or v2's
    cpu.stat; None in the root cgroup or where neither is readable."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if path in ("", "/"):
            continue
        if "cpuacct" in controllers.split(","):
            counter = root / controllers / path.lstrip("/") / "cpuacct.usage"
        elif controllers == "":
            counter = root / "unified" / path.lstrip("/") / "cpu.stat"
            if not counter.exists():
                counter = root / path.lstrip("/") / "cpu.stat"
        else:
            continue
        if read_ns(counter) is not None:
            return counter
    return None


def read_ns(counter: Path) -> int | None:
    """The counter in nanoseconds: cpuacct.usage holds them, cpu.stat's usage_usec microseconds."""
    try:
        text = counter.read_text()
    except OSError:
        return None
    if counter.name == "cpuacct.usage":
        return int(text.strip() or 0)
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) * 1000
    return None


class CpuPerTest:
    def __init__(self, counter: Path) -> None:
        self.counter = counter

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        start = read_ns(self.counter)
        if start is not None:
            item.stash[_START] = start
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):
        try:
            return (yield)
        finally:
            # before the teardown report is made: junitxml writes that report's properties
            start, end = item.stash.get(_START, None), read_ns(self.counter)
            if start is not None and end is not None:
                item.user_properties.append(("cpu_s", f"{(end - start) / 1e9:.1f}"))


def pytest_configure(config: pytest.Config) -> None:
    counter = lane_counter()
    if counter is not None and config.getoption("xmlpath", None):
        config.pluginmanager.register(CpuPerTest(counter), "epd-cpu-per-test")
