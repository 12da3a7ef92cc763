"""docs/router.md "Failure outcomes" cannot drift from the tests: every row fills every column
and names at least one test, each named test exists (a module-level `def`/`async def` in that
file), and the faults the table must cover (issue 43) each have a row."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "router.md"
HEADING = "### Failure outcomes"
COLUMNS = ["fault", "the client sees", "retried", "charged", "metric", "tests"]
# the faults the table publishes at least (a row's first cell contains each)
REQUIRED = (
    "VE refuses connections",
    "VE refuses the request's content",
    "VE hangs",
    "blocks of the wrong shape",
    "side channel down",
    "PD cannot read blocks",
    "PD dies mid-stream",
    "PD hangs mid-stream",
    "generation error",
)
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def table_rows(text: str) -> list[list[str]]:
    """The cells of the section's table, header first."""
    start = text.index(HEADING)
    end = text.find("\n#", start + len(HEADING))
    section = text[start : end if end != -1 else len(text)]
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@cache
def defined(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


ROWS = table_rows(DOC.read_text())


def test_the_table_has_its_columns_and_every_required_fault():
    assert ROWS and ROWS[0] == COLUMNS, ROWS[:1]
    faults = [row[0] for row in ROWS[1:]]
    assert len(set(faults)) == len(faults), "a fault has two rows"
    missing = [f for f in REQUIRED if not any(f in fault for fault in faults)]
    assert not missing, f"docs/router.md '{HEADING}' has no row for {missing}"


@pytest.mark.parametrize("row", ROWS[1:], ids=lambda row: row[0][:40])
def test_each_row_is_complete_and_names_tests_that_exist(row):
    assert len(row) == len(COLUMNS) and all(row), f"a column is missing or empty: {row}"
    refs = REF.findall(row[-1])
    assert refs, f"no test named as `tests/...py::test_name`: {row[-1]}"
    assert len(refs) == row[-1].count("`") // 2, f"a reference not of the form `tests/...py::test_name`: {row[-1]}"
    for path, name in refs:
        assert (ROOT / path).is_file(), f"{path} does not exist"
        assert name.startswith("test_") and name in defined(path), f"{path} defines no {name}"


def test_the_checker_catches_a_row_without_a_real_test():
    header = f"| {' | '.join(COLUMNS)} |\n|---|---|---|---|---|---|\n"
    doc = f"{HEADING}\n\n{header}| x | y | z | w | m | `tests/nope.py::test_x` |\n"
    (row,) = table_rows(doc)[1:]
    with pytest.raises(AssertionError, match="does not exist"):
        test_each_row_is_complete_and_names_tests_that_exist(row)
