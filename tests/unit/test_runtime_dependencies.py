"""The kit imports only its runtime dependencies: every epd_kit module imports in a fresh
interpreter in which the packages of the test and bench extras that are not runtime
dependencies (pyproject.toml, docs/dependencies.md) cannot be imported. A host's venv has only
the runtime set; an import of one of these would fail there, not here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.budget import scaled

# in the test/bench extras, deliberately not in the runtime dependencies (docs/dependencies.md)
NOT_AT_RUNTIME = ("transformers", "aiohttp")

PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    blocked = set(sys.argv[1:])

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"{name} is not a runtime dependency of the kit")

    sys.meta_path.insert(0, Block())
    import epd_kit
    names = [m.name for m in pkgutil.walk_packages(epd_kit.__path__, "epd_kit.")]
    for name in names:
        importlib.import_module(name)
    loaded = sorted(b for b in blocked if b in sys.modules)
    assert not loaded, loaded
    print(len(names))
    """
)


def test_every_kit_module_imports_without_the_test_only_packages():
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *NOT_AT_RUNTIME], capture_output=True, text=True, timeout=scaled(120), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip()) > 50  # the walk found the kit's modules
