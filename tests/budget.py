"""Time budgets that scale with the machine (docs/sandbox.md "Budgets that scale with the machine").

Every wait of the harnesses has a base budget: what it needs, with room, on the quiet 2-core VM.
On a busy machine the same work takes longer (issue 55: a run beside other work, load 8-35, ran
past a fixed 600 s deploy timeout and pytest-timeout's 300 s while real engines started), so a
deadline is the base times the machine's factor: a fixed piece of Python work (the speed probe
scripts/test.sh prints) timed once per process, over its quiet time. The factor is at least 1
(a quiet machine keeps the base budgets) and at most MAX_FACTOR (past that, a wait that still
runs out is a hang, not a slow machine). scripts/test.sh exports its own reading, taken before
the tiers start, as EPD_SPEED_PROBE_S; the slower of that and this process's reading counts.

    from tests.budget import scaled
    wait_for(ready, timeout=scaled(60), what="...")     # or a harness wait, which scales itself
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

# sum(range(30_000_000)) on the quiet VM: 0.39-0.56 s in the quiet full runs of docs/sandbox.md
# "Timings" (the speed probe column); the top of that range, so a quiet reading gives factor 1
QUIET_PROBE_S = 0.56
MAX_FACTOR = 12.0
PROBE_ENV = "EPD_SPEED_PROBE_S"  # scripts/test.sh's reading ("0.52s" or "0.52")
FACTOR_ENV = "EPD_BUDGET_FACTOR"  # a factor given by hand (e.g. 1 to keep the base budgets)


def probe() -> float:
    """Seconds for scripts/test.sh's speed_probe work in this process."""
    start = time.perf_counter()
    sum(range(30_000_000))
    return time.perf_counter() - start


@functools.cache
def factor() -> float:
    """The machine's slowness against the quiet VM, measured once per process; 1 to MAX_FACTOR."""
    given = os.environ.get(FACTOR_ENV)
    if given:
        try:
            return min(MAX_FACTOR, max(1.0, float(given)))
        except ValueError:
            raise ValueError(f"{FACTOR_ENV}={given!r}: give a number, e.g. 1 or 2.5") from None
    readings = [probe()]
    exported = os.environ.get(PROBE_ENV, "").strip().removesuffix("s")
    with contextlib.suppress(ValueError):  # not run by scripts/test.sh: this process's reading alone
        readings.append(float(exported))
    return min(MAX_FACTOR, max(1.0, max(readings) / QUIET_PROBE_S))


def scaled(base_s: float) -> float:
    """The deadline for a wait whose quiet-machine budget is `base_s` seconds."""
    return base_s * factor()


def describe(base_s: float) -> str:
    """How a budget was set, for a timeout's message: "412 s (base 300 s x 1.37, the speed probe)"."""
    return f"{_s(scaled(base_s))} s (base {_s(base_s)} s x {factor():.2f}, the speed probe)"


def _s(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"
