"""The real Prometheus server for tests (Debian's `prometheus`, installed by scripts/bootstrap.sh):
on 127.0.0.1, a free port, bounded in time, answering instant queries. The dashboard checks
(tests/ansible/test_observability_config.py) and the one-host sandbox (tests/e2e/test_one_host.py)
both query it."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from epd_kit.testing.process import ManagedProcess, free_port
from tests.budget import scaled

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# the server never outlives this (a base budget, scaled to the machine), whatever happens to the
# test process
LIFETIME_S = 900


class PrometheusServer:
    """Started on construction with `config` (a prometheus.yml), its data and log in `directory`;
    ready once it answers a query."""

    def __init__(self, config: Path, directory: Path) -> None:
        if not Path(PROMETHEUS).exists():
            pytest.fail(
                "no prometheus binary: scripts/bootstrap.sh installs Debian's prometheus package", pytrace=False
            )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = ["timeout", f"{scaled(LIFETIME_S):.0f}", PROMETHEUS, f"--config.file={config}"]
        argv += [f"--storage.tsdb.path={directory / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
        argv += ["--storage.tsdb.retention.time=1h"]
        self.process = ManagedProcess(argv, directory / "prometheus.log", name="prometheus")
        try:
            self.process.wait_until(lambda: self.answers("vector(1)"), scaled(30), "answering queries", interval=0.25)
        except BaseException:
            self.stop()
            raise

    def query(self, promql: str) -> list[dict]:
        """The instant query's result; a query Prometheus refuses fails naming it."""
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5, trust_env=False)
        assert reply.status_code == 200, f"{promql}: {reply.text}"
        return reply.json()["data"]["result"]

    def answers(self, promql: str) -> bool:
        """Whether the query has a result now (False while the server cannot answer yet)."""
        try:
            return bool(self.query(promql))
        except (httpx.HTTPError, AssertionError):
            return False

    def value(self, promql: str) -> float:
        """The first sample's value, 0 without a result."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        self.process.stop(20)
