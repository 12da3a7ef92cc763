"""The observability role (docs/observability.md): file_sd targets, prometheus.yml and alert rules
rendered by playbooks/observability.yml and checked by the real promtool; the alert rules' unit
tests; every alert's runbook section; every dashboard query against a scrape of a running
router and sim engines (tests/router_processes/harness.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epd_kit import plan as planner
from epd_kit.testing.checkpoint import build_tiny_checkpoint
from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.ansible.helpers import REPO, inventory_hostvars, playbook
from tests.router_processes.harness import Stack

pytestmark = pytest.mark.ansible

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DASHBOARD = REPO / "roles/epd_observability/files/epd-dashboard.json"
RULE_TESTS = REPO / "observability/epd-alerts.test.yml"
DOCS = REPO / "docs/observability.md"
# the monitoring host of these renders: the controller itself
MONITORING = {
    "all": {
        "children": {
            "epd_monitoring": {
                "hosts": {
                    "localhost": {
                        "ansible_connection": "local",
                        # the address the engines' access rules let the scraper in from (the
                        # controller on the sandbox bridge; docs/security.md "Who can reach what")
                        "epd_bind_address": "10.213.0.1",
                        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                    }
                }
            }
        }
    }
}


def with_monitoring(source: Path, dest: Path, engines: dict[str, dict] | None = None) -> Path:
    """A copy of inventory `source` with localhost in epd_monitoring (and engine counts changed)."""
    shutil.copytree(source, dest)
    if engines:
        hosts = yaml.safe_load((dest / "hosts.yml").read_text())
        for name, values in engines.items():
            hosts["all"]["children"]["epd_engines"]["hosts"][name].update(values)
        (dest / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (dest / "monitoring.yml").write_text(yaml.safe_dump(MONITORING))
    return dest


def observe(inventory: Path, out: Path) -> Path:
    """playbooks/observability.yml into `out`, with a complete prometheus.yml and the dashboard."""
    result = playbook(
        "-i",
        str(inventory),
        "playbooks/observability.yml",
        "-e",
        f"epd_observability_dir={out}",
        "-e",
        f"epd_observability_prometheus_config={out}/prometheus.yml",
        "-e",
        f"epd_observability_grafana_dir={out}/grafana",
        "-e",
        f"epd_observability_promtool={PROMTOOL}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return out


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def three_host(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("observability")
    return observe(with_monitoring(REPO / "inventory/sandbox/three-host", tmp / "inventory"), tmp / "out")


def test_targets_cover_every_engine_and_router_with_their_labels(three_host):
    hostvars, groups = inventory_hostvars(REPO / "inventory/sandbox/three-host")
    fleet_plan = planner.plan_from_hostvars(hostvars, groups["epd_engines"])
    engines = json.loads((three_host / "epd-engines.json").read_text())
    routers = json.loads((three_host / "epd-router.json").read_text())
    assert [(e["targets"], e["labels"]) for e in engines] == [
        (
            [f"{e['host']}:{e['port']}"],
            {"host": name, "role": e["role"], "engine_id": e["engine_id"], "instance": e["instance"]},
        )
        for name, host_plan in fleet_plan.items()
        for e in host_plan["engines"]
    ]
    assert sorted(t for e in engines for t in e["targets"]) == [
        "10.213.0.11:18300",
        "10.213.0.11:18301",
        "10.213.0.12:18100",
        "10.213.0.12:18101",
    ]
    assert [r["targets"] for r in routers] == [["10.213.0.13:18800"]]


def test_promtool_accepts_the_config_and_the_rules(three_host):
    config = promtool("check", "config", str(three_host / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    rules = promtool("check", "rules", str(three_host / "epd-alerts.rules.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_alert_rules_unit_tests(three_host, tmp_path):
    """promtool test rules: pool below its floor, an ejected engine, a target down (observability/)."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(three_host / "epd-alerts.rules.yml")]
    (tmp_path / "epd-alerts.test.yml").write_text(yaml.safe_dump(tests))
    result = promtool("test", "rules", str(tmp_path / "epd-alerts.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {t["alertname"] for group in tests["tests"] for t in group["alert_rule_test"]}
    assert {"EpdPoolBelowCapacityFloor", "EpdEngineEjected"} <= tested


def test_every_alert_has_a_runbook_section(three_host):
    rules = yaml.safe_load((three_host / "epd-alerts.rules.yml").read_text())["groups"][0]["rules"]
    docs = DOCS.read_text()
    headings = {m.lower() for m in re.findall(r"^### (\w+)$", docs.split("## Runbook", 1)[1], re.M)}
    for rule in rules:
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor == rule["alert"].lower() and anchor in headings, rule["alert"]
        assert f"`{rule['alert']}`" in docs.split("## Runbook", 1)[0], f"{rule['alert']} not in the alerts table"


def test_removed_engines_leave_the_targets(three_host, tmp_path):
    inventory = with_monitoring(
        REPO / "inventory/sandbox/three-host", tmp_path / "inventory", {"n2": {"epd_num_pd": 1}}
    )
    out = observe(inventory, tmp_path / "out")
    targets = sorted(t for e in json.loads((out / "epd-engines.json").read_text()) for t in e["targets"])
    assert targets == ["10.213.0.11:18300", "10.213.0.11:18301", "10.213.0.12:18100"]


def test_grafana_provider_points_at_the_dashboard(three_host):
    provider = yaml.safe_load((three_host / "grafana/epd-dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == str(three_host / "grafana")
    assert json.loads((three_host / "grafana/epd-dashboard.json").read_text()) == json.loads(DASHBOARD.read_text())


# --- the dashboard against what the stack exports ---------------------------------------------

PROMQL_WORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}
)
# series Prometheus makes itself, not scraped
SYNTHETIC = frozenset({"up"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping,
    functions and keywords removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if match.group() not in PROMQL_WORDS and not rest.startswith("("):
            names.add(match.group())
    return names


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can carry, including labelled families without samples yet."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    variables = [v for v in dashboard["templating"]["list"] if "definition" in v]
    # label_values(SELECTOR, LABEL): the selector is the query
    queries += [(v["name"], re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["definition"])) for v in variables]
    return queries


def test_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le) (rate(epd_router_pd_seconds_bucket{host=~"$host"}[$__rate_interval])))'
    ) == {"epd_router_pd_seconds_bucket"}
    assert metric_names('a_total / on (x) b{le="5.0"} > 0.1 and vllm:c[5m] offset 1h') == {"a_total", "b", "vllm:c"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Names on the /metrics pages of a running router, one VE and one PD (after one image request)."""
    tmp = tmp_path_factory.mktemp("scrape")
    stack = Stack.start(build_tiny_checkpoint(tmp / "tiny-qwen3-vl"), tmp, n_ve=1, n_pd=1)
    try:
        message = user_message(image_part(png_data_url(64, 64)), "What is in the picture?")
        body = {"model": str(stack.ckpt), "max_tokens": 4, "messages": [message]}
        reply = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)
        assert reply.status_code == 200, reply.text
        names: set[str] = set()
        for url in [stack.router.url, *(e.url for e in stack.ves + stack.pds)]:
            names |= exported_names(httpx.get(url + "/metrics", timeout=5, trust_env=False).text)
        return names
    finally:
        stack.stop()


def test_every_dashboard_query_names_exported_metrics(exported):
    queries = dashboard_queries()
    assert len(queries) > 20
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr}"
        missing = names - exported - SYNTHETIC
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which neither router nor engines export"


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"host", "engine"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["description"] and panel["targets"], panel.get("title")
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert f"| {panel['title']} |" in DOCS.read_text(), f"panel {panel['title']!r} missing from docs"
