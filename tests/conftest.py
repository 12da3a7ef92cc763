"""Shared by every tier. Keep it small: fixtures here must be useful to more than one tier."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `tests.hosts` is importable from any test directory
    sys.path.insert(0, str(REPO))

pytest_plugins = ["tests.hosts.fixtures"]
