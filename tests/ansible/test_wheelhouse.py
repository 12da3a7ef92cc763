"""The controller's wheelhouse build under deploy --check: it reports what it would build and
writes nothing (epd_deps passes --dry-run in check mode)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.ansible.helpers import REPO
from tests.budget import scaled

BUILD = REPO / "roles/epd_deps/files/build_wheelhouse.py"


def test_dry_run_reports_the_build_and_writes_nothing(tmp_path):
    cache = tmp_path / "wheelhouse"
    argv = [sys.executable, str(BUILD), "--repo", str(REPO), "--cache", str(cache), "--dry-run"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(60), check=True)
    report = json.loads(result.stdout)
    assert report["changed"] is True
    assert report["archive"] == str(cache / f"epd-wheelhouse-{report['key']}.tar")
    assert not cache.exists()
