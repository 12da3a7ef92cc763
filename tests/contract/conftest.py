"""Fixtures for the contract tier: tiny checkpoint, engine launchers that always clean up."""

from __future__ import annotations

import sys
from pathlib import Path

# Test the code of this checkout even if the shared venv's editable install points elsewhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "router"))

import json
from collections.abc import Iterator

import pytest
from sim_harness import IMAGE_TOKEN_ID_KEY, Launcher, Pair, start_pair

from epd_kit.sim.checkpoint import CheckpointInfo, load_checkpoint
from epd_kit.testing.checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointInfo:
    return load_checkpoint(build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-vl-tiny"))


@pytest.fixture(scope="session")
def text_only_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-tiny", text_only=True)


@pytest.fixture(scope="session")
def image_token_id(checkpoint: CheckpointInfo) -> int:
    return json.loads((checkpoint.path / "config.json").read_text())[IMAGE_TOKEN_ID_KEY]


def _launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("engines"))
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.fixture
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    yield from _launcher(tmp_path_factory)


@pytest.fixture(scope="session")
def session_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    yield from _launcher(tmp_path_factory)


@pytest.fixture(scope="session")
def pair(session_launcher: Launcher, checkpoint: CheckpointInfo) -> Pair:
    """A healthy 1E1PD started exactly like the tutorial, shared by tests that keep it healthy
    (tests that kill an engine start their own)."""
    return start_pair(session_launcher, str(checkpoint.path))
