"""epd_kit.testing.process: the one start / wait-for-health / fail-fast / stop piece that the sim
launcher, the benches and the tests share. Real child processes on 127.0.0.1 only."""

from __future__ import annotations

import signal
import socket
import sys

import pytest

from epd_kit.testing import process
from epd_kit.testing.process import ManagedProcess, ProcessFailed, free_port, http_status, stop_all


def test_free_port_is_bindable_and_nothing_answers_there():
    port = free_port()
    assert 1024 <= port <= 65535
    assert http_status(f"http://127.0.0.1:{port}/health", timeout=0.5) is None


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may give a closed probe's port again; two engines of one stack then shared it
    (a VE answered for a PD). Here the kernel is made to repeat itself."""
    ports = iter([41000, 41000, 41001, 41000, 41001, 41002])
    real_socket = socket.socket

    class RepeatingKernel(real_socket):
        def getsockname(self):
            return ("127.0.0.1", next(ports))

    monkeypatch.setattr(process.socket, "socket", RepeatingKernel)
    monkeypatch.setattr(process, "_handed_out", set())
    assert [free_port(), free_port(), free_port()] == [41000, 41001, 41002]


def test_a_child_that_exits_fails_the_wait_at_once_with_its_log(tmp_path):
    child = ManagedProcess(
        [sys.executable, "-c", "print('bad flag --enable-magic'); raise SystemExit(2)"], tmp_path / "c.log", name="sim"
    )
    with pytest.raises(ProcessFailed, match=r"(?s)sim \(pid \d+\) exited with 2:.*bad flag --enable-magic"):
        child.wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=30)
    assert child.returncode == 2


def test_wait_http_returns_once_the_endpoint_answers_200_and_stop_ends_the_child(tmp_path):
    port = free_port()
    child = ManagedProcess(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        tmp_path / "s.log",
    )
    try:
        child.wait_http(f"http://127.0.0.1:{port}/", timeout=30)
        assert http_status(f"http://127.0.0.1:{port}/no-such-file") == 404
    finally:
        child.stop(10)
    assert child.returncode == -signal.SIGTERM


def test_a_child_that_never_gets_ready_times_out_with_its_log_and_stop_all_ends_it(tmp_path):
    child = ManagedProcess(
        [sys.executable, "-c", "import time; print('compiling', flush=True); time.sleep(60)"], tmp_path / "w.log"
    )
    try:
        child.wait_until(lambda: "compiling" in child.log(), timeout=30, what="compiling")
        with pytest.raises(ProcessFailed, match=r"(?s)not ready after 0.2 s:.*compiling"):
            child.wait_until(lambda: False, timeout=0.2)
    finally:
        stop_all([child], timeout=5)
    assert child.returncode == -signal.SIGTERM
