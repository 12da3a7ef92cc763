"""What a sim and a router import to start (docs/sandbox.md "Starting a sim and a router"): no
FastAPI in either (epd_kit/asgi.py), no numpy in a sim (with the first image item), no httpx in a
router (with the first http(s) image URL), no numpy or Pillow in a router (with the first image).
Each was a tenth to four tenths of a CPU-second per start, paid ~280 times a test run and on
every restart of a fleet's units."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epd_kit.testing.checkpoint import build_tiny_checkpoint
from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.budget import scaled

STARTS = {
    "sim": (("epd_kit.sim.cli", "epd_kit.sim.server", "epd_kit.sim.app", "uvicorn"), ("fastapi", "numpy", "httpx")),
    "router": (
        ("epd_kit.cli", "epd_kit.router.server", "epd_kit.router.app", "epd_kit.preprocess.preprocessor", "uvicorn"),
        ("fastapi", "httpx", "rich", "numpy", "PIL"),
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


def test_a_router_loads_numpy_and_pillow_with_its_first_image(tmp_path):
    """The production renderer of a vision checkpoint is built (the checkpoint checked) without
    numpy and Pillow: its pixel encoder, decoder and item encoder come with the first image."""
    message = user_message("what is it?", image_part(png_data_url(96, 64)))
    probe = f"""
import asyncio, sys
from epd_kit.preprocess import Preprocessor

async def main():
    pre = Preprocessor.from_checkpoint({str(build_tiny_checkpoint(tmp_path / "ckpt"))!r})
    print(sorted(m for m in ("numpy", "PIL") if m in sys.modules))
    rendered = await pre.render([{message!r}])
    print(rendered.items[0].grid_thw, sorted(m for m in ("numpy", "PIL") if m in sys.modules))
    await pre.aclose()

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=scaled(60), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 96x64 grows past min_pixels to 320x224 (tests/unit/preprocess/test_media.py)
    assert done.stdout.splitlines() == ["[]", "(1, 14, 20) ['PIL', 'numpy']"], done.stdout
