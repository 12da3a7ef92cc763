"""The router's log lines (router/logs.py): one JSON object per line; on the event loop the
lines of one loop turn are written together when the turn ends; tracebacks included."""

from __future__ import annotations

import asyncio
import json
import logging

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
    root.handlers[:], root.level, root.propagate = saved


async def test_lines_of_a_loop_turn_are_written_when_it_ends(router_logging, capsys):
    logs.setup_logging("INFO")
    log = logging.getLogger("epd_router.app")
    log.info("request done", extra={"request_id": "r1", "status": 200})
    log.debug("not at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("internal error", extra={"request_id": "r2"})
    assert capsys.readouterr().err == ""  # still this turn: nothing written yet
    await asyncio.sleep(0)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["msg"], d["request_id"]) for d in lines] == [("request done", "r1"), ("internal error", "r2")]
    assert lines[0]["status"] == 200 and lines[0]["level"] == "info" and lines[0]["ts"].endswith("Z")
    assert "ValueError: boom" in lines[1]["exc"]


def test_without_a_loop_lines_are_written_at_once_and_flush_writes_what_is_kept(router_logging, capsys):
    logs.setup_logging("INFO")
    logging.getLogger("epd_router.server").warning("no loop here", extra={"worker": "1"})
    assert json.loads(capsys.readouterr().err)["worker"] == "1"
    handler = router_logging.handlers[0]
    handler._pending.append(logging.makeLogRecord({"name": "epd_router.x", "msg": "kept", "levelname": "INFO"}))
    handler.flush()  # logging.shutdown at exit
    assert json.loads(capsys.readouterr().err)["msg"] == "kept"
