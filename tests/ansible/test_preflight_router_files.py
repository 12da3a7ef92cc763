"""deploy's host preflight checks the API keys file a router host's configuration names (the kit never
writes it) by the router's own rule, before any change: `epd-router check-config` would refuse a
missing or group-readable file only when the router's configuration is written, after the engines
rolled (issue 56)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import playbook

pytestmark = pytest.mark.ansible


def preflight(tmp_path: Path, keys_file: Path) -> tuple[int, str]:
    play = {
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable, "epd_router_api_keys_file": str(keys_file)},
        "tasks": [{"ansible.builtin.include_role": {"name": "epd.kit.epd_preflight", "tasks_from": "router_files"}}],
    }
    book = tmp_path / "router-files.yml"
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    result = playbook(str(book))
    return result.returncode, " ".join((result.stdout + result.stderr).split())


def test_a_missing_or_readable_api_keys_file_is_refused_and_a_private_one_passes(tmp_path):
    keys = tmp_path / "api-keys"
    code, output = preflight(tmp_path, keys)
    assert code != 0 and f"localhost: epd_router_api_keys_file {keys} does not exist: the kit never writes it" in output
    keys.write_text("sk-3f9c1b2e7d4a60c8b1e5\n")
    keys.chmod(0o640)
    code, output = preflight(tmp_path, keys)
    assert code != 0
    assert f"has mode 0640: group or others may read it (the router refuses it); run: chmod 600 {keys}" in output
    keys.chmod(0o600)
    code, output = preflight(tmp_path, keys)
    assert code == 0, output[-3000:]
