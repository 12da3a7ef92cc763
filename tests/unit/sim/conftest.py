"""Unit-tier fixtures for the simulated engine: checkpoints on disk, engine configs."""

from __future__ import annotations

import sys
from pathlib import Path

# Test the code of this checkout even if the shared venv's editable install points elsewhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "router"))

import json

import pytest

from epd_kit.testing.checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def qwen32b_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json only, with Qwen3-VL-32B's vision geometry (no tokenizer, no weights)."""
    path = tmp_path_factory.mktemp("ckpt") / "qwen3-vl-32b"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3VLForConditionalGeneration"],
                "text_config": {"vocab_size": 151936, "eos_token_id": 151645},
                "vision_config": {
                    "out_hidden_size": 5120,
                    "deepstack_visual_indexes": [8, 16, 24],
                    "patch_size": 16,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                    "in_channels": 3,
                },
            }
        )
    )
    return path
