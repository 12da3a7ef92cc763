"""Pre-build the deps role's offline wheelhouse on the controller BEFORE entering the kithub
network namespace (which has no route to any package index).

`deploy.yml` builds the wheelhouse on the controller itself (roles/epd_deps), keyed by the
kit's sources, the pins and the Python version, and reuses a cached one. Inside kithub that
build cannot download anything, so scripts/test.sh and scripts/demo.sh call this first with
the same builder, cache and pins as the role: the deploy then finds it cached.

    python tests/hosts/wheelhouse.py      prints the builder's JSON line
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles/epd_deps"
BUILDER = ROLE / "files/build_wheelhouse.py"
CACHE = REPO / ".cache/wheelhouse"  # the role's default epd_deps_wheelhouse_cache


def sim_pins() -> list[str]:
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    return list(defaults.get("epd_deps_sim_pins") or [])


def main() -> int:
    if not BUILDER.exists():
        print(f"wheelhouse: {BUILDER.relative_to(REPO)} not in this checkout; nothing to pre-build")
        return 0
    argv = [sys.executable, str(BUILDER), "--repo", str(REPO), "--cache", str(CACHE)]
    argv += [f"--pin={pin}" for pin in sim_pins()]
    return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
