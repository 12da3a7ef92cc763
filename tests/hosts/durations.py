"""The full run's test durations, for scripts/test.sh's summary: every pytest process of a run
writes a JUnit report named after its lane (e2e-a.xml, e2e-b.xml, host-free.xml; test.sh
`pytest_run`); this prints the slowest tests of all lanes together and each lane's modules with
their summed time, so a run's log shows where each lane's length went and how even the two e2e
lanes are (tests/e2e/conftest.py LANE_B). A JUnit test case's `time` is its setup + call +
teardown (pytest's default `junit_duration_report = total`), so a module's first test carries the
boot and first deploy of its stack. Standard library only: test.sh runs it with the system
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
            cases.append(Case(seconds, report.stem, case.get("classname") or "", case.get("name") or ""))
    return cases


def module_totals(cases: list[Case]) -> dict[str, list[ModuleTotal]]:
    """lane -> its modules, the longest first, each with its tests' summed time."""
    sums: dict[tuple[str, str], list[float]] = {}
    for case in cases:
        sums.setdefault((case.lane, case.module), []).append(case.seconds)
    lanes: dict[str, list[ModuleTotal]] = {}
    for (lane, module), times in sums.items():
        lanes.setdefault(lane, []).append(ModuleTotal(lane, module, sum(times), len(times)))
    for modules in lanes.values():
        modules.sort(key=lambda m: (-m.seconds, m.module))
    return dict(sorted(lanes.items()))


def summary(cases: list[Case], slowest: int = 20, modules_per_lane: int = 12) -> list[str]:
    """The lines test.sh prints: the `slowest` tests of all lanes, then per lane its total and its
    `modules_per_lane` longest modules (every module of an e2e lane: a few, and the ones to balance)."""
    lines = [f"== slowest {slowest} tests (setup + call + teardown, all lanes)"]
    for case in sorted(cases, key=lambda c: -c.seconds)[:slowest]:
        lines.append(f"   {case.seconds:8.1f}s  {case.lane:<10} {case.classname}::{case.name}")
    lines.append(f"   ({len(cases)} tests, {sum(c.seconds for c in cases):.0f} s in all)")
    lines.append("== modules per lane (setup + call + teardown summed; a lane's tests run one after another)")
    for lane, modules in module_totals(cases).items():
        total, tests = sum(m.seconds for m in modules), sum(m.tests for m in modules)
        lines.append(f"   {lane:<10} {total:8.1f}s  = the lane: {tests} tests in {len(modules)} modules")
        shown = modules if lane.startswith("e2e-") else modules[:modules_per_lane]
        for m in shown:
            lines.append(f"   {lane:<10} {m.seconds:8.1f}s  {m.module} ({m.tests} tests)")
        rest = modules[len(shown) :]
        if rest:
            lines.append(f"   {lane:<10} {sum(m.seconds for m in rest):8.1f}s  ({len(rest)} more modules)")
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
