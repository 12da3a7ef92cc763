"""The ops playbooks' own logic against this machine, read-only: status, engine selection, rolling queue.

The host is this controller (ansible_connection=local) with a fake deployment in a temp
directory (epd_engine_env_dir, epd_router_config_file): the playbooks read the same paths deploy
writes, from epd_common. Every probe goes to 127.0.0.1; nothing is started, stopped or written.
"""

from __future__ import annotations

import http.server
import socket
import sys
import threading

import pytest
import yaml

from tests.ansible.helpers import playbook

pytestmark = pytest.mark.ansible


class _Probe(http.server.BaseHTTPRequestHandler):
    """An engine that is healthy and a router that is not ready, on one port."""

    def do_GET(self):
        self.send_response({"/health": 200, "/ready": 503}.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Probe)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_port
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def deployment(tmp_path, server):
    """An inventory whose one host (this machine) has pd-0 healthy, ve-0 down and a router not ready."""
    engines = tmp_path / "etc/engines"
    engines.mkdir(parents=True)
    (engines / "pd-0.env").write_text(f"# Ansible managed\nEPD_HEALTH_URL='http://127.0.0.1:{server}/health'\n")
    (engines / "ve-0.env").write_text(f"EPD_HEALTH_URL='http://127.0.0.1:{closed_port()}/health'\n")
    router_config = tmp_path / "etc/router.yaml"
    router_config.write_text(yaml.safe_dump({"listen": {"host": "0.0.0.0", "port": server}}))
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "epd_num_ve": 1,
        "epd_num_pd": 1,
        "epd_engine_env_dir": str(engines),
        "epd_router_config_file": str(router_config),
    }
    inventory = tmp_path / "inv"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {"epd_model": "/models/m"},
                    "children": {"epd_engines": {"hosts": {"h1": host}}, "epd_router": {"hosts": {"h1": None}}},
                }
            }
        )
    )
    return inventory


def test_status_table_reads_the_deployed_engines_and_probes_them(deployment):
    result = playbook("-i", str(deployment), "playbooks/status.yml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = [line.strip(" -'") for line in result.stdout.splitlines()]
    rows = [line for line in lines if " epd-" in line or line.split()[0:2] == ["HOST", "UNIT"]]
    assert [row.split()[0:2] for row in rows] == [
        ["HOST", "UNIT"],
        ["h1", "epd-engine@pd-0.service"],
        ["h1", "epd-engine@ve-0.service"],
        ["h1", "epd-router.service"],
    ]
    assert rows[1].endswith(" ok") and rows[2].endswith(" down (-1)") and rows[3].endswith(" not ready (503)")


def test_an_unknown_engine_stops_an_ops_playbook_before_it_acts(deployment):
    result = playbook("-i", str(deployment), "playbooks/stop.yml", "-e", "engines=epd-pd-0,pd-9")
    assert result.returncode != 0
    assert "unknown engines pd-9: deployed are pd-0 " in " ".join(result.stdout.split())
    assert "Stop the" not in result.stdout


def test_rolling_restart_refuses_an_engine_that_is_not_planned(deployment):
    result = playbook("-i", str(deployment), "playbooks/rolling_restart.yml", "-e", "engines=ve-0,pd-4")
    assert result.returncode != 0
    assert "unknown engines pd-4; planned are epd-pd-0, epd-ve-0" in " ".join((result.stdout + result.stderr).split())
    assert "Drain, restart and return" not in result.stdout


def test_rolling_restart_refuses_a_batch_that_breaks_the_floor_before_it_acts(deployment):
    result = playbook("-i", str(deployment), "playbooks/rolling_restart.yml", "-e", "epd_rollout_batch_pd=2")
    assert result.returncode != 0
    output = " ".join((result.stdout + result.stderr).split())
    assert "epd_rollout_batch_pd: 2 is more than the 1 PD engines planned; set it to at most 1" in output
    assert "Drain, restart and return" not in result.stdout
