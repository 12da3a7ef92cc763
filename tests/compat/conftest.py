"""The vLLM-compat tier: the kit's wire bodies against vLLM 0.24.0's own code (docs/compat.md).

It runs only in the environment scripts/compat-env.sh builds; anywhere else it fails, with
the command to run, before a test module is imported. The kit is imported from this
checkout (router/), whatever the interpreter has installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

VLLM_VERSION = "0.24.0"
REPO = Path(__file__).resolve().parents[2]
HOW_TO_RUN = "run it in its environment: scripts/compat-env.sh pytest tests/compat (docs/compat.md)"


def _environment_problem() -> str | None:
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return f"vllm is not installed in {sys.prefix}"
    if version != VLLM_VERSION:
        return f"vllm {version} is installed in {sys.prefix}, this tier pins {VLLM_VERSION}"
    return None


if (_problem := _environment_problem()) is not None:
    raise pytest.UsageError(f"the vLLM-compat tier cannot run here: {_problem}; {HOW_TO_RUN}")

sys.path.insert(0, str(REPO / "router"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny checkpoint is local; never the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _use_the_cpu_platform() -> None:
    """vLLM picks no platform on a machine without an accelerator; its CPU platform is what
    the API server and the processors need (nothing here runs a model)."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = vllm.platforms.current_platform = CpuPlatform()


_use_the_cpu_platform()

from epd_kit.testing.checkpoint import build_tiny_checkpoint

from tests.compat.sim_engines import SimPair
from tests.compat.stack import CompatStack


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
    """The kit's simulated VE + PD, with the same tutorial argv as the vLLM engines."""
    with SimPair.start(checkpoint, tmp_path_factory.mktemp("sims")) as pair:
        yield pair
