"""Setup and fixtures of the vLLM-compat tier, imported by its conftest inside the compat
environment only: this checkout's kit first on sys.path, no hub, no usage report, and vLLM's
CPU platform."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO / "router"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny checkpoint is local; never the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # vLLM's usage report is never sent from here
os.environ["DO_NOT_TRACK"] = "1"


def _use_the_cpu_platform() -> None:
    """vLLM picks no platform on a machine without an accelerator; its CPU platform is what
    the API server and the processors need (nothing here runs a model)."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = vllm.platforms.current_platform = CpuPlatform()


_use_the_cpu_platform()

from epd_kit.testing.checkpoint import build_tiny_checkpoint  # noqa: E402 (vLLM's platform is chosen first)
from tests.compat.sim_engines import SimPair  # noqa: E402 (vLLM's platform is chosen first)
from tests.compat.stack import CompatStack  # noqa: E402 (vLLM's platform is chosen first)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CompatStack]:
    """vLLM VE + vLLM PD (stand-in engine cores) and the kit's router in front of them."""
    with CompatStack.start(checkpoint, tmp_path_factory.mktemp("stack")) as running:
        yield running


@pytest.fixture(scope="session")
def sims(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimPair]:
    """The kit's simulated VE + PD, with the same tutorial argv as the vLLM engines (the sim
    answers as every vLLM this tier runs: epd_kit/sim/release.py SERIES)."""
    with SimPair.start(checkpoint, tmp_path_factory.mktemp("sims")) as pair:
        yield pair
