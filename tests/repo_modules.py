"""Import the kit's Ansible plugins (plain Python files outside the package) in tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load(relpath: str, name: str) -> ModuleType:
    """Import REPO/relpath once as module `name` (registered first: dataclasses look it up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    assert spec is not None and spec.loader is not None, relpath
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def filters() -> ModuleType:
    """The collection's filter plugin: thin shims over epd_kit.plan."""
    return load("plugins/filter/epd_kit.py", "epd_kit_filters")


def module(name: str) -> ModuleType:
    """One of the collection's Ansible modules (they run on the hosts, so they are not in epd_kit)."""
    return load(f"plugins/modules/{name}.py", name)
