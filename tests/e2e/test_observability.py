"""Observability on the one-host sandbox (docs/observability.md): the deploy's last play writes
the scrape targets and a prometheus.yml on the controller (group epd_monitoring = localhost), the
real Prometheus server (Debian's package) scrapes the whole fleet from there, and PromQL over
its HTTP API (127.0.0.1 only) shows every target up and a request moving the router's request,
TTFT and encode series and the VE's encoder-cache series. The engines compile for a few
simulated seconds, so a restart prints their progress.

The inventory is inventory/sandbox/one-host with two changes: the engines bind to n1's address
(a Prometheus off the host must reach them) and the sim compiles for EPD_SIM_COMPILE_S."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from epd_kit.testing.process import free_port
from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import Stack, image_message, wait_for
from tests.hosts.harness import REPO, ansible_playbook, copy_inventory

pytestmark = pytest.mark.systemd

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
COMPILE_S = "10"
LIFETIME_S = 600  # Prometheus never outlives this, whatever happens to the test process


def monitored_one_host(dest: Path, prometheus_dir: Path) -> Path:
    """inventory/sandbox/one-host + engines on n1's address + a slow sim compile + epd_monitoring."""
    copy_inventory(REPO / "inventory/sandbox/one-host", dest)
    hosts = yaml.safe_load((dest / "hosts.yml").read_text())
    n1 = hosts["all"]["children"]["epd_engines"]["hosts"]["n1"]
    n1["epd_bind_address"] = n1["ansible_host"]
    (dest / "hosts.yml").write_text(yaml.safe_dump(hosts))
    settings_file = dest / "group_vars/all/epd.yml"
    settings = yaml.safe_load(settings_file.read_text())
    settings["epd_engine_environment"]["EPD_SIM_COMPILE_S"] = COMPILE_S
    # every start compiles, the restart too (a warm compile cache would skip it: docs/sim.md)
    settings["epd_engine_environment"]["NEURON_LIBTORCH_DISABLE_COMPILE_CACHE"] = "1"
    settings_file.write_text(yaml.safe_dump(settings))
    monitoring = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "epd_observability_dir": str(prometheus_dir),
        "epd_observability_prometheus_config": str(prometheus_dir / "prometheus.yml"),
        "epd_observability_scrape_interval_s": 1,
    }
    doc = {"all": {"children": {"epd_monitoring": {"hosts": {"localhost": monitoring}}}}}
    (dest / "monitoring.yml").write_text(yaml.safe_dump(doc))
    return dest


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen

    def query(self, promql: str) -> list[dict]:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5, trust_env=False)
        reply.raise_for_status()
        return reply.json()["data"]["result"]

    def value(self, promql: str) -> float:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else 0.0


@dataclass
class Monitored:
    stack: Stack
    inventory: Path
    prometheus: Prometheus


@pytest.fixture(scope="module")
def monitored(host_pool, record_timing, tmp_path_factory) -> Iterator[Monitored]:
    if not Path(PROMETHEUS).exists():
        pytest.fail("no prometheus binary: scripts/bootstrap.sh installs Debian's prometheus package", pytrace=False)
    tmp = tmp_path_factory.mktemp("observability")
    inventory = monitored_one_host(tmp / "inventory", tmp / "prometheus")
    stack = deploy_stack(host_pool, inventory, record_timing, "1 host + prometheus")
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [
                "timeout",
                str(LIFETIME_S),
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus/prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prometheus = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        wait_for(lambda: prometheus.query("vector(1)"), timeout=30, what="prometheus to answer")
        yield Monitored(stack, inventory, prometheus)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_every_router_and_engine_target_is_up(monitored):
    prometheus = monitored.prometheus

    def all_up() -> list[dict]:
        targets = prometheus.query('up{role=~"ve|pd|router"}')
        return targets if len(targets) == 4 and all(t["value"][1] == "1" for t in targets) else []

    targets = wait_for(all_up, timeout=60, what="4 targets up in prometheus")
    labels = sorted((t["metric"]["role"], t["metric"]["instance"], t["metric"]["host"]) for t in targets)
    assert labels == [("pd", "pd-0", "n1"), ("pd", "pd-1", "n1"), ("router", "router", "n1"), ("ve", "ve-0", "n1")]
    engine_ids = {t["metric"].get("engine_id") for t in targets if t["metric"]["role"] != "router"}
    assert engine_ids == {e["id"] for e in monitored.stack.pools()}  # the router's endpoints


def test_a_request_moves_the_request_ttft_and_encode_series(monitored):
    prometheus, stack = monitored.prometheus, monitored.stack
    series = {
        "requests": 'sum(epd_router_requests_total{status="200"})',
        "ttft": "sum(epd_router_time_to_first_token_seconds_count)",
        "encode": "sum(epd_router_encode_seconds_count)",
        "ve cache queries": 'sum(vllm:encoder_cache_queries_total{role="ve"})',
        "pd generated tokens": 'sum(vllm:generation_tokens_total{role="pd"})',
    }
    wait_for(lambda: prometheus.query("epd_router_encode_seconds_count"), timeout=30, what="a router scrape")
    before = {name: prometheus.value(q) for name, q in series.items()}
    reply = stack.chat(image_message("What is in the picture? (observability)", (200, 30, 30)), max_tokens=4)
    assert reply.choices[0].message.content is not None

    def moved() -> dict[str, float]:
        after = {name: prometheus.value(q) for name, q in series.items()}
        return after if all(after[name] > before[name] for name in series) else {}

    after = wait_for(moved, timeout=30, what=f"every series to move from {before}")
    assert after["requests"] == before["requests"] + 1


def test_restart_prints_each_engines_progress_and_the_slowest(monitored):
    start = time.monotonic()
    result = ansible_playbook(monitored.inventory, "playbooks/restart.yml", "-e", "component=engines")
    assert result.returncode == 0, result.describe()
    assert time.monotonic() - start >= float(COMPILE_S)
    for instance in ("pd-0", "pd-1", "ve-0"):
        assert f"[n1] {instance}: compiling" in result.stdout, result.stdout[-4000:]
        assert f"[n1] {instance}: ready" in result.stdout, result.stdout[-4000:]
    assert "slowest: " in result.stdout, result.stdout[-4000:]
    monitored.stack.wait_ready(timeout=60)
