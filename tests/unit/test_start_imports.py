"""What a sim and a router import to start (docs/sandbox.md "Starting a sim and a router"): no
FastAPI in either (epd_kit/asgi.py), no numpy in a sim (with the first image item), no httpx in a
router (with the first http(s) image URL). Each was a tenth to four tenths of a CPU-second per
start, paid ~280 times a test run and on every restart of a fleet's units."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.budget import scaled

STARTS = {
    "sim": (("epd_kit.sim.cli", "epd_kit.sim.server", "epd_kit.sim.app", "uvicorn"), ("fastapi", "numpy", "httpx")),
    "router": (
        ("epd_kit.cli", "epd_kit.router.server", "epd_kit.router.app", "epd_kit.preprocess.preprocessor", "uvicorn"),
        ("fastapi", "httpx", "rich"),
    ),
}


@pytest.mark.parametrize("process", sorted(STARTS))
def test_a_start_does_not_import_what_only_a_later_request_needs(process):
    modules, absent = STARTS[process]
    probe = f"import sys, {', '.join(modules)}; print(sorted(m for m in {list(absent)!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=scaled(60), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"a {process} start imports {done.stdout.strip()}"
