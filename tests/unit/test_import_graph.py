"""No import circles in epd_kit and no arrow up: the graph of every import in router/epd_kit, read
with ast (so an import inside a function, which hides a circle at run time, and an `if
TYPE_CHECKING:` import count as much as one at the top), has no cycle, the planner never
imports the router (the router.yaml schema it checks is the bottom module epd_kit.router_yaml,
the tenants file's format plan/tenants_format.py), and the router does not import the advisor
(the advisor reads the router's metrics; epd_kit/cli.py joins the two CLIs). A circle or an arrow
up is named module by module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "router"
PACKAGE = "epd_kit"


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
    """The dotted names one import statement asks for (`from a import b` asks for a.b and a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's own package upwards
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. `from pkg import x` is an edge to pkg.x when x
    is a module, else to pkg (a name its __init__ defines)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            wanted = _imported(node, name, is_package)
            if isinstance(node, ast.ImportFrom):
                submodules = [w for w in wanted[:-1] if w in modules]
                wanted = submodules if len(submodules) == len(wanted) - 1 else [*submodules, wanted[-1]]
            edges.update(w for w in wanted if w in modules and w != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path
    that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_a_circle(graph, component) for component in components]


def _a_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"not a cycle: {sorted(component)}")


def test_epd_kit_has_no_import_circle():
    graph = import_graph(module_files())
    assert len(graph) > 50, "the package was not found"
    found = cycles(graph)
    assert not found, "import circles (late and TYPE_CHECKING imports included):\n" + "\n".join(
        " -> ".join(circle) for circle in found
    )


# (importer, imported): no module under the first imports one under the second (a package and
# its modules: "epd_kit.plan" is epd_kit/plan/ whole). The planner runs on the controller
# without the router's runtime; the router.yaml schema both read sits below both.
FORBIDDEN = (
    ("epd_kit.plan", "epd_kit.router"),
    ("epd_kit.router_yaml", "epd_kit.router"),
    ("epd_kit.router_yaml", "epd_kit.advise"),
    ("epd_kit.router", "epd_kit.advise"),
)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{importer} -> {imported} ({low} may not import {high})"
        for importer, imports in graph.items()
        for imported in imports
        for low, high in FORBIDDEN
        if _under(importer, low) and _under(imported, high)
    )


def test_the_planner_never_imports_the_router():
    graph = import_graph(module_files())
    assert "epd_kit.router_yaml" in graph and "epd_kit.router_yaml" in graph["epd_kit.plan.router_check"]
    found = arrows_up(graph)
    assert not found, "imports against the layers (late and TYPE_CHECKING imports included):\n" + "\n".join(found)


def test_the_advisor_command_joins_the_router_s_from_above():
    graph = import_graph(module_files())
    # the one place the two CLIs meet imports both (the `epd-router` script)
    assert {f"{PACKAGE}.router.cli", f"{PACKAGE}.advise.cli"} <= graph[f"{PACKAGE}.cli"]


def test_an_arrow_up_is_named(tmp_path):
    """A late import from the planner into the router is found, named by both modules; a module
    whose name only starts like the router's (router_yaml) is no arrow up."""
    package = tmp_path / PACKAGE
    for sub in ("plan", "router"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "router_yaml.py").write_text("")
    (package / "router" / "config.py").write_text("")
    (package / "plan" / "check.py").write_text("def f():\n    from epd_kit.router.config import x\n")
    (package / "plan" / "ok.py").write_text("from epd_kit import router_yaml\n")
    assert arrows_up(import_graph(module_files(tmp_path))) == [
        "epd_kit.plan.check -> epd_kit.router.config (epd_kit.plan may not import epd_kit.router)"
    ]


def test_a_late_import_and_a_type_checking_import_make_a_circle(tmp_path):
    """The reader sees what run time hides: a circle closed by an import inside a function, and
    one closed by an `if TYPE_CHECKING:` import, each of a relative and an absolute import."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (package / "c.py").write_text("from epd_kit.sub.d import y\n")
    (package / "sub" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from epd_kit import c\n"
    )
    (package / "e.py").write_text("import epd_kit.sub.b\n")
    found = cycles(import_graph(module_files(tmp_path)))
    assert sorted(found) == [["epd_kit.a", "epd_kit.sub.b", "epd_kit.a"], ["epd_kit.c", "epd_kit.sub.d", "epd_kit.c"]]
