"""The full run's test durations, for scripts/test.sh's summary: every pytest process of a run
writes a JUnit report named after its lane (e2e-a.xml, e2e-b.xml, host-free.xml; test.sh
`pytest_run`); this prints the slowest tests of all lanes together and each lane's modules with
their summed time, so a run's log shows where each lane's length went and how even the two e2e
lanes are (tests/e2e/conftest.py LANE_B). A JUnit test case's `time` is its setup + call +
teardown (pytest's default `junit_duration_report = total`), so a module's first test carries the
boot and first deploy of its stack. Where a lane ran in a cgroup of its own, each case also
carries its CPU-s (the `cpu_s` property, tests/hosts/cpu_per_test.py): the run is CPU-bound, so
the tests and modules that cost the most CPU are listed too. Standard library only: test.sh runs it with the system
python3.

    python3 tests/hosts/durations.py DIR [SLOWEST [MODULES]]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    seconds: float
    lane: str  # the report's name: e2e-a, e2e-b, host-free
    classname: str  # tests.e2e.test_one_host, or tests.unit.test_x.TestY for a class's tests
    name: str
    cpu: float | None = None  # CPU-s of the lane's cgroup over the test, where it was measured

    @property
    def module(self) -> str:
        """The test's module: its classname up to the first class (a CamelCase part)."""
        parts = self.classname.split(".")
        for i, part in enumerate(parts):
            if part[:1].isupper():
                return ".".join(parts[:i]) or self.classname
        return self.classname


@dataclass(frozen=True)
class ModuleTotal:
    lane: str
    module: str
    seconds: float
    tests: int
    cpu: float | None = None  # None when no test of the module has a CPU-s figure


def read_reports(directory: Path) -> list[Case]:
    """Every test case of every report in `directory`; a report that does not parse (a lane stopped
    before pytest wrote it whole) is left out."""
    cases = []
    for report in sorted(directory.glob("*.xml")):
        try:
            root = ET.parse(report).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            seconds = float(case.get("time") or 0)
            cpu = next((float(p.get("value") or 0) for p in case.iter("property") if p.get("name") == "cpu_s"), None)
            cases.append(Case(seconds, report.stem, case.get("classname") or "", case.get("name") or "", cpu))
    return cases


def module_totals(cases: list[Case]) -> dict[str, list[ModuleTotal]]:
    """lane -> its modules, the longest first, each with its tests' summed time."""
    sums: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        sums.setdefault((case.lane, case.module), []).append(case)
    lanes: dict[str, list[ModuleTotal]] = {}
    for (lane, module), its in sums.items():
        total = ModuleTotal(lane, module, sum(c.seconds for c in its), len(its), summed_cpu([c.cpu for c in its]))
        lanes.setdefault(lane, []).append(total)
    for modules in lanes.values():
        modules.sort(key=lambda m: (-m.seconds, m.module))
    return dict(sorted(lanes.items()))


def summed_cpu(cpus: list[float | None]) -> float | None:
    """The sum of the figures measured; None when none was."""
    measured = [c for c in cpus if c is not None]
    return sum(measured) if measured else None


def row(lane: str, seconds: float, cpu: float | None, what: str) -> str:
    cpu_s = f"{cpu:7.1f}" if cpu is not None else "      ?"
    return f"   {seconds:8.1f}s {cpu_s} CPU-s  {lane:<10} {what}"


def summary(cases: list[Case], slowest: int = 20, modules_per_lane: int = 12) -> list[str]:
    """The lines test.sh prints: the `slowest` tests of all lanes, then the `slowest` that cost the
    most CPU (where measured), then per lane its total and its `modules_per_lane` longest modules
    (every module of an e2e lane: a few, and the ones to balance)."""
    lines = [f"== slowest {slowest} tests (setup + call + teardown, all lanes)"]
    lines += [
        row(c.lane, c.seconds, c.cpu, f"{c.classname}::{c.name}")
        for c in sorted(cases, key=lambda c: -c.seconds)[:slowest]
    ]
    lines.append(f"   ({len(cases)} tests, {sum(c.seconds for c in cases):.0f} s in all)")
    measured = sorted((c for c in cases if c.cpu is not None), key=lambda c: -(c.cpu or 0))
    if measured:
        lines.append(f"== most CPU: {slowest} tests (their lane's cgroup from setup to teardown, test hosts included)")
        lines += [row(c.lane, c.seconds, c.cpu, f"{c.classname}::{c.name}") for c in measured[:slowest]]
        lines.append(f"   ({len(measured)} tests measured, {sum(c.cpu or 0 for c in measured):.0f} CPU-s in all)")
    lines.append("== modules per lane (setup + call + teardown summed; a lane's tests run one after another)")
    for lane, modules in module_totals(cases).items():
        total, tests = sum(m.seconds for m in modules), sum(m.tests for m in modules)
        cpu = summed_cpu([m.cpu for m in modules])
        lines.append(row(lane, total, cpu, f"= the lane: {tests} tests in {len(modules)} modules"))
        shown = modules if lane.startswith("e2e-") else modules[:modules_per_lane]
        lines += [row(lane, m.seconds, m.cpu, f"{m.module} ({m.tests} tests)") for m in shown]
        rest = modules[len(shown) :]
        if rest:
            rest_cpu = summed_cpu([m.cpu for m in rest])
            lines.append(row(lane, sum(m.seconds for m in rest), rest_cpu, f"({len(rest)} more modules)"))
    return lines


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_dir():
        print("usage: durations.py DIR [SLOWEST [MODULES]] (DIR: the run's JUnit reports)", file=sys.stderr)
        return 2
    numbers = [int(a) for a in argv[1:3]]
    print("\n".join(summary(read_reports(Path(argv[0])), *numbers)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
