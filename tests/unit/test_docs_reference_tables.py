"""The reference tables no other test read, held to the tree: docs/planner.md's module map,
filters and variables, docs/architecture.md's repository layout and docs/router.md's code map.
A module, filter, planner variable or folder added without its row fails here, and so does a
row naming one that is gone. (Tables generated or parsed elsewhere: architecture.md "Every
variable", tests/unit/plan/test_variables.py; planner.md's bad inventories and rules,
tests/unit/plan/test_checks.py; router.md "Failure outcomes", tests/unit/router/
test_failure_outcomes_table.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from epd_kit.plan.variables import ENGINE, FLEET, HOST, VARIABLES
from tests import repo_modules

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "router" / "epd_kit"
TICKED = re.compile(r"`([^`]+)`")


def section(page: str, heading: str) -> str:
    """The text of the section under `heading` ("## ..."), up to the next heading of its level."""
    text = "\n" + (REPO / "docs" / page).read_text()
    start = text.index(f"\n{heading}\n") + 1
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def first_cells(text: str) -> list[str]:
    """The first cell of every table row (header and separator rows left out)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            cells.append(re.split(r"(?<!\\)\|", line.strip().strip("|"))[0].strip())
    return cells[1:] if cells and cells[0] in ("module", "filter", "variable") else cells


def modules(folder: Path) -> set[str]:
    return {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}


def test_planner_md_maps_every_module_of_the_planner():
    cells = first_cells((REPO / "docs" / "planner.md").read_text().split("\n## ", 1)[0])
    named = {name for cell in cells for name in TICKED.findall(cell)}
    assert named == modules(PACKAGE / "plan"), (
        f"docs/planner.md's module table: missing {sorted(modules(PACKAGE / 'plan') - named)}, "
        f"no such module {sorted(named - modules(PACKAGE / 'plan'))}"
    )


def test_planner_md_lists_every_filter_of_the_collection():
    filters = set(repo_modules.filters().FilterModule().filters())
    cells = first_cells(section("planner.md", "## Filters"))
    named = {name for cell in cells for name in re.findall(r"(?:epd\.kit\.|`)(epd_[a-z_]+)\b(?!/)", cell)}
    assert filters - named == set(), f"docs/planner.md 'Filters' has no row for {sorted(filters - named)}"
    assert named - filters == set(), f"docs/planner.md 'Filters' names filters that do not exist: {named - filters}"


def planner_variables() -> set[str]:
    """What the planner reads from the inventory: epd_common's `plan` entry point's fleet-wide,
    per-host and engine-host variables, and epd_text_only (read by the inventory check only)."""
    planned = {
        name for name, var in VARIABLES.items() if var.spec == "epd_common.plan" and var.scope in (FLEET, HOST, ENGINE)
    }
    return planned | {"epd_text_only"}


def test_planner_md_tables_every_variable_of_the_planner():
    cells = first_cells(section("planner.md", "## Variables"))
    named = {name for cell in cells for name in re.findall(r"`(epd_\w+)`", cell)}
    expected = planner_variables()
    assert expected - named == set(), f"docs/planner.md 'Variables' has no row for {sorted(expected - named)}"
    assert named - expected == set(), (
        f"docs/planner.md 'Variables' lists what the planner does not read: {named - expected}"
    )


def layout_entries() -> list[str]:
    """The first column of architecture.md's layout listing (the second code block), as paths."""
    blocks = re.findall(r"```\n(.*?)```", section("architecture.md", "## Repository layout"), re.S)
    entries, parent = [], ""
    for line in blocks[1].splitlines():
        if not line.strip() or line.startswith("      "):  # a continuation of the line above
            continue
        first = re.match(r"(?:\S+, )*\S+", line.strip())[0]  # "galaxy.yml, meta/": two entries
        for name in first.split(", "):
            if line.startswith("  "):
                entries.append(parent + name)
            else:
                entries.append(name)
                parent = name if name.endswith("/") else parent
    return entries


def test_architecture_md_lays_out_every_folder_and_package_module():
    entries = set(layout_entries())
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/", 1)[0] + ("/" if "/" in path else "") for path in tracked if not path.startswith(".")}
    package = {
        p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__")
    }
    tests = {f"tests/{p.name}/" for p in (REPO / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    expected = top | {f"router/epd_kit/{name}" for name in package} | tests
    # a folder is laid out by its own line or by lines of what is inside it (inventory/examples/)
    missing = {entry for entry in expected - entries if not any(e.startswith(entry) for e in entries)}
    assert not missing, f"docs/architecture.md 'Repository layout' has no line for {sorted(missing)}"
    gone = [entry for entry in entries if not (REPO / entry).exists()]
    assert not gone, f"docs/architecture.md 'Repository layout' names what does not exist: {gone}"


def test_router_md_maps_every_module_of_the_router():
    cells = first_cells(section("router.md", "## Code map (router/epd_kit/router/)"))
    named = {name.removesuffix(".py") for cell in cells for name in TICKED.findall(cell)}
    actual = modules(PACKAGE / "router")
    assert named == actual, (
        f"docs/router.md 'Code map': missing {sorted(actual - named)}, gone {sorted(named - actual)}"
    )
