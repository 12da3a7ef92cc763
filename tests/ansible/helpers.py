"""Tier 2 helpers: run real ansible-playbook / ansible-inventory from the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
INVENTORIES = sorted(
    [p for p in (REPO / "inventory/examples").iterdir() if (p / "hosts.yml").exists()]
    + [p for p in (REPO / "inventory/sandbox").iterdir() if (p / "hosts.yml").exists()]
)
INVENTORY_IDS = [f"{p.parent.name}/{p.name}" for p in INVENTORIES]


def ansible_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_LOCAL_TEMP": str(Path(os.environ.get("TMPDIR", "/tmp")) / "epd-ansible-tmp"),
            "PATH": f"{BIN}:{env.get('PATH', '')}",
        }
    )
    env.pop("HF_TOKEN", None)
    env.update(extra)
    return env


def run(argv: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=REPO, env=ansible_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )


def playbook(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return run([str(BIN / "ansible-playbook"), *args], timeout=timeout, **env)


def inventory_hostvars(inventory: Path) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(hostvars, groups) of an inventory, as ansible-inventory resolves them."""
    result = run([str(BIN / "ansible-inventory"), "-i", str(inventory), "--list"])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    hostvars = data["_meta"]["hostvars"]
    groups: dict[str, list[str]] = {}

    def hosts_of(group: str) -> list[str]:
        entry = data.get(group, {})
        out = list(entry.get("hosts", []))
        for child in entry.get("children", []):
            out += [h for h in hosts_of(child) if h not in out]
        return out

    for group in ("epd_engines", "epd_router"):
        groups[group] = hosts_of(group)
    return hostvars, groups
