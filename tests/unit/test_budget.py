"""tests/budget.py: the harnesses' waits scale with the machine (docs/sandbox.md "Budgets that
scale with the machine")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import budget
from tests.router_processes.harness import wait_until


def test_the_factor_is_measured_within_its_bounds_and_scales_every_budget():
    assert 1.0 <= budget.factor() <= budget.MAX_FACTOR
    assert budget.scaled(60) == pytest.approx(60 * budget.factor())
    assert budget.describe(300).startswith(f"{budget.scaled(300):.0f} s (base 300 s x ")
    assert budget.describe(0.5).startswith(f"{budget.scaled(0.5):.1f} s (base 0.5 s x ")


@pytest.mark.parametrize(
    ("environment", "factor"),
    [
        ({"EPD_BUDGET_FACTOR": "2.5"}, 2.5),
        ({"EPD_BUDGET_FACTOR": "0.5"}, 1.0),  # never below the quiet machine's budgets
        ({"EPD_BUDGET_FACTOR": "99"}, budget.MAX_FACTOR),
        # scripts/test.sh's reading counts when it is the slower one: 4 x the quiet probe
        ({"EPD_SPEED_PROBE_S": f"{4 * budget.QUIET_PROBE_S:.3f}s"}, 4.0),
    ],
)
def test_the_factor_comes_from_the_environment_when_given(environment, factor):
    code = "from tests import budget; print(budget.factor())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(budget.__file__).rsplit("/tests/", 1)[0], **environment}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    if "EPD_SPEED_PROBE_S" in environment:
        assert float(out) >= factor  # this process's own reading may be slower still
    else:
        assert float(out) == pytest.approx(factor)


def test_a_bad_factor_is_refused_with_what_to_give():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(budget.__file__).rsplit("/tests/", 1)[0]}
    done = subprocess.run(
        [sys.executable, "-c", "from tests import budget; budget.factor()"],
        capture_output=True,
        text=True,
        env={**env, "EPD_BUDGET_FACTOR": "fast"},
        check=False,
    )
    assert done.returncode != 0 and "EPD_BUDGET_FACTOR='fast': give a number" in done.stderr


@pytest.mark.timeout(7)
def test_a_tests_own_timeout_mark_is_scaled_by_the_suites_conftest(request):
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(7 * budget.factor())


def test_the_default_timeout_is_scaled_too(request):
    base = float(request.config.getoption("timeout", None) or request.config.getini("timeout"))  # pyproject: 300
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(base * budget.factor())


def test_a_wait_that_runs_out_names_what_it_waited_for_and_its_budget():
    expected = r"timed out after [\d.]+ s \(base 0.1 s x [\d.]+, the speed probe\) waiting for a condition"
    with pytest.raises(AssertionError, match=expected):
        wait_until(lambda: False, 0.1, "a condition that never holds")
