"""epd_kit.healthwait: the engines' ExecStartPost readiness gate, against real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.ansible.helpers import REPO

pytestmark = pytest.mark.ansible


class _Health(http.server.BaseHTTPRequestHandler):
    ready_after = 0.0
    started = 0.0

    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() - self.started >= self.ready_after
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def healthwait(url: str, timeout_s: float, env: dict | None = None) -> tuple[int, float, str]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "epd_kit.healthwait", url, str(timeout_s), "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "router"), **(env or {})},
    )
    return result.returncode, time.monotonic() - start, result.stderr


def test_returns_once_health_answers_200(server):
    _Health.started, _Health.ready_after = time.monotonic(), 0.6
    rc, elapsed, _ = healthwait(f"http://127.0.0.1:{server.server_port}/health", 10)
    assert rc == 0 and 0.5 <= elapsed < 8


def test_times_out_when_nothing_answers():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connection refused
        rc, elapsed, err = healthwait(f"http://127.0.0.1:{port}/health", 1.0)
    assert rc == 1 and elapsed < 6 and "not ready after" in err


def test_fails_fast_when_the_main_process_died(server):
    _Health.started, _Health.ready_after = time.monotonic(), 3600
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rc, elapsed, err = healthwait(f"http://127.0.0.1:{server.server_port}/health", 20, {"MAINPID": str(dead.pid)})
    assert rc == 1 and elapsed < 6 and "exited before" in err
