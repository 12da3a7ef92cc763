"""Shared by every tier. Keep it small: fixtures here must be useful to more than one tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `tests.hosts` is importable from any test directory
    sys.path.insert(0, str(REPO))

from tests import budget  # noqa: E402  (after the path above)

pytest_plugins = ["tests.hosts.fixtures", "tests.hosts.cpu_per_test"]


def pytest_report_header(config: pytest.Config) -> str:
    return f"time budgets: base x {budget.factor():.2f} (tests/budget.py: the speed probe against the quiet VM)"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limit per test (pyproject's 300 s, or a module's own `timeout` mark) is a
    base budget: each test gets it scaled to the machine (tests/budget.py), as its closest mark."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker else ([], {})
        base = args.pop(0) if args else kwargs.pop("timeout", default)
        if base:
            item.add_marker(pytest.mark.timeout(budget.scaled(float(base)), *args, **kwargs), append=False)
