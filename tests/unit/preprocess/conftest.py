"""Fixtures for the preprocessing tests: one tiny checkpoint per session, built offline."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from epd_kit.preprocess import Limits, Media, Preprocessor
from epd_kit.testing.checkpoint import build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers comparisons must never reach the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def text_only_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", text_only=True)


@pytest.fixture
async def make_preprocessor(checkpoint: Path) -> AsyncIterator[Callable[..., Preprocessor]]:
    """Factory: make_preprocessor(limits=..., media=..., **kwargs); closed after the test."""
    made: list[Preprocessor] = []

    def factory(path: Path | None = None, **kwargs: object) -> Preprocessor:
        kwargs.setdefault("limits", Limits())
        kwargs.setdefault("media", Media())
        kwargs.setdefault("workers", 2)
        pre = Preprocessor.from_checkpoint(path or checkpoint, **kwargs)  # type: ignore[arg-type]
        made.append(pre)
        return pre

    yield factory
    for pre in made:
        await pre.aclose()


@pytest.fixture
async def pre(make_preprocessor: Callable[..., Preprocessor]) -> Preprocessor:
    return make_preprocessor()
