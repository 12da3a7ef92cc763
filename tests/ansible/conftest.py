"""Tier 2 fixtures (helpers live in tests/ansible/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ansible.helpers import playbook


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    """render(inventory) -> output dir; each inventory is rendered once per session."""
    cache: dict[Path, Path] = {}

    def render(inventory: Path) -> Path:
        if inventory not in cache:
            out = tmp_path_factory.mktemp(f"render-{inventory.name}")
            result = playbook("-i", str(inventory), "playbooks/render.yml", "-e", f"render_dir={out}")
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
            cache[inventory] = out
        return cache[inventory]

    return render
