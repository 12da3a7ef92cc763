"""The router's log lines (router/logs.py): one JSON object per line, written by a writer
thread (the event loop only queues the record), tracebacks included."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from epd_kit.router import logs


@pytest.fixture
def router_logging(monkeypatch):
    """setup_logging changes process-wide logging state: put all of it back afterwards."""
    root = logging.getLogger("epd_router")
    for name in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing", "logAsyncioTasks"):
        if hasattr(logging, name):
            monkeypatch.setattr(logging, name, getattr(logging, name))
    saved = (root.handlers[:], root.level, root.propagate)
    yield root
    logs.stop_logging()
    root.handlers[:], root.level, root.propagate = saved


def test_lines_are_formatted_and_written_off_the_logging_thread(router_logging, capsys, monkeypatch):
    formatted_in: set[int] = set()
    real_format = logs.JsonFormatter.format

    def spy(self, record):
        formatted_in.add(threading.get_ident())
        return real_format(self, record)

    monkeypatch.setattr(logs.JsonFormatter, "format", spy)
    logs.setup_logging("INFO")
    log = logging.getLogger("epd_router.app")
    log.info("request done", extra={"request_id": "r1", "status": 200})
    log.debug("not at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("internal error", extra={"request_id": "r2"})
    logs.stop_logging()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["msg"], d["request_id"]) for d in lines] == [("request done", "r1"), ("internal error", "r2")]
    assert lines[0]["status"] == 200 and lines[0]["level"] == "info" and lines[0]["ts"].endswith("Z")
    assert "ValueError: boom" in lines[1]["exc"]
    assert formatted_in and threading.get_ident() not in formatted_in
