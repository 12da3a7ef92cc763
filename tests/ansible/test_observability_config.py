"""The observability role (docs/observability.md): file_sd targets, prometheus.yml and alert rules
rendered by playbooks/observability.yml and checked by the real promtool; the alert rules' unit
tests; every alert's runbook section; every dashboard query against a scrape of a running
router and sim engines (tests/router_processes/harness.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epd_kit import plan as planner
from epd_kit.testing.checkpoint import build_tiny_checkpoint
from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.ansible.helpers import REPO, inventory_hostvars, playbook
from tests.budget import scaled
from tests.prometheus import PrometheusServer
from tests.router_processes.harness import Stack, wait_until

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
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=scaled(60), check=False)


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


def dashboard_variables() -> dict[str, tuple[str, str]]:
    """{name: (selector, label)} of the dashboard's query variables: label_values(SELECTOR, LABEL)."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {}
    for v in dashboard["templating"]["list"]:
        if "definition" in v:
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["definition"])
            assert match, f"variable {v['name']}: {v['definition']} is not label_values(SELECTOR, LABEL)"
            assert v.get("allValue") == ".*", f"variable {v['name']}: All must be .* (every value, none left out)"
            out[v["name"]] = (match[1], match[2])
    return out


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """Every panel's query, and each variable's selector (the query of its values)."""
    return panel_queries() + [(name, selector) for name, (selector, _) in dashboard_variables().items()]


# what Grafana puts in for its own variables
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def expand(expr: str, values: dict[str, str]) -> str:
    """`expr` as Grafana sends it: each $name / ${name} replaced by `values[name]` (a dashboard
    variable's value) or Grafana's own; a variable the dashboard does not define fails."""

    def value(match: re.Match) -> str:
        name = match[1] or match[2]
        if name in values:
            return values[name]
        assert name in GRAFANA_VARIABLES, f"{expr} uses ${name}, which the dashboard does not define"
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def regex_value(value: str) -> str:
    """One selected value in a `=~"..."` matcher, as Grafana's Prometheus source escapes it."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def at_all() -> dict[str, str]:
    return dict.fromkeys(dashboard_variables(), ".*")


def test_every_dashboard_variable_is_defined():
    """Each $variable of a panel or a variable's query is the dashboard's or Grafana's own; the
    check refuses an unknown one."""
    for title, expr in dashboard_queries():
        assert "$" not in expand(expr, at_all()), title
    with pytest.raises(AssertionError, match=r"uses \$tenant, which the dashboard does not define"):
        expand('sum(rate(epd_router_requests_total{tenant=~"$tenant"}[$__rate_interval]))', at_all())
    assert {"host", "engine", "model"} <= set(dashboard_variables())


def test_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le) (rate(epd_router_pd_seconds_bucket{host=~"$host"}[$__rate_interval])))'
    ) == {"epd_router_pd_seconds_bucket"}
    assert metric_names('a_total / on (x) b{le="5.0"} > 0.1 and vllm:c[5m] offset 1h') == {"a_total", "b", "vllm:c"}


def scraping(stack: Stack, directory: Path) -> PrometheusServer:
    """The real Prometheus server scraping the stack every second with the labels the kit's
    targets carry, once every target is up and scraped often enough for a rate over the panels'
    range."""

    def target(url: str, role: str, engine_id: str, instance: str) -> dict:
        labels = {"host": "n1", "role": role, "engine_id": engine_id, "instance": instance}
        return {"targets": [url.removeprefix("http://")], "labels": labels}

    engines = [target(e.url, e.role, e.engine_id, e.engine_id.removeprefix("epd-")) for e in stack.ves + stack.pds]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # as the kit's prometheus.yml: the router's per-engine series keep their engine's role
            {
                "job_name": "epd-router",
                "honor_labels": True,
                "static_configs": [target(stack.router.url, "router", "", "router")],
            },
            {"job_name": "epd-engines", "static_configs": engines},
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = PrometheusServer(directory / "prometheus.yml", directory)
    try:
        scraped = f"count((count_over_time(up[1m]) >= 3) and (up == 1)) == {1 + len(engines)}"
        wait_until(lambda: server.answers(scraped), 30, "every target up and scraped 3 times", interval=0.25)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class Scraped:
    names: set[str]  # every series name the router's and the engines' /metrics carry
    prometheus: PrometheusServer
    model: str  # the router's one model's served name


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Iterator[Scraped]:
    """A running router, one VE and one PD (after one image request), and Prometheus scraping them."""
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
        prometheus = scraping(stack, tmp)
        try:
            yield Scraped(names, prometheus, str(stack.ckpt))
        finally:
            prometheus.stop()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def exported(scraped) -> set[str]:
    return scraped.names


def test_every_dashboard_query_names_exported_metrics(exported):
    queries = dashboard_queries()
    assert len(queries) > 20
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr}"
        missing = names - exported - SYNTHETIC
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which neither router nor engines export"


def test_every_dashboard_query_runs_and_keeps_its_data_for_each_value_a_variable_offers(scraped):
    """Every panel's query on the real Prometheus with the variables at All (`.*`), then with each
    variable set to one value its own query offers: a panel that shows data at All must show it for
    some value of each variable, so a filter on a label its series lack (`model` on an engine's
    vllm:* series) fails here. Queries without data at All count nothing that happened here
    (retries, rejections, failures)."""
    prometheus = scraped.prometheus
    everything = at_all()
    offered = {}
    for name, (selector, label) in dashboard_variables().items():
        values = [
            r["metric"].get(label, "") for r in prometheus.query(f"group by ({label}) ({expand(selector, everything)})")
        ]
        assert values, f"variable {name} offers no value: {selector}"
        offered[name] = values
    assert offered["model"] == [scraped.model]  # the one model's served name (here its checkpoint)
    with_data = []
    for title, expr in panel_queries():
        if not prometheus.query(expand(expr, everything)):
            continue
        with_data.append(title)
        for name, values in offered.items():
            assert any(prometheus.query(expand(expr, {**everything, name: regex_value(value)})) for value in values), (
                f"panel {title!r} shows nothing for any {name} the dashboard offers ({values}): {expr}"
            )
    # 24 of 31 here: all but the error ratio, rejections, quarantines, engine failures (two),
    # retries and reloads, which count events this run has none of
    assert len(with_data) >= 24, with_data


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"host", "engine", "model"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["description"] and panel["targets"], panel.get("title")
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        # docs/observability.md "Dashboard": the panel's row with its queries as they are
        queries = "<br>".join(f"`{t['expr']}`".replace("|", "\\|") for t in panel["targets"])
        assert f"| {panel['title']} | {queries} |" in DOCS.read_text(), f"panel {panel['title']!r}: docs differ"
