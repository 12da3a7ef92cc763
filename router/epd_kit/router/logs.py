"""Structured logs: one JSON object per line, with the request id when there is one.

Callers pass context through `extra={...}`; secrets and image data are never put there.

Cheap enough for one line per request at INFO (the deployed level). On the event loop a
record is only kept: the lines of one loop turn are formatted and written together when the
turn ends (`_EndOfTurn`), after the responses of that turn went out, in one write. Records
skip what the lines do not show: the caller's frame, thread, process and task names (the
Logging HOWTO's "Optimization" switches). Measured: a writer thread instead cost more CPU
and latency than it saved (every record woke it and it competed for the GIL;
docs/benchmarks.md "Peers").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
import time

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
# LogRecord.__init__ sets these first; `extra` keys come after them, so they are skipped
# unread (the filter below still guards what follows)
_INIT_KEYS = len(logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__)
_dumps = json.JSONEncoder(default=str).encode  # json.dumps(doc, default=str) without a new encoder per line


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # one strftime per second, not per line
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        doc = {
            "ts": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in itertools.islice(record.__dict__.items(), _INIT_KEYS, None):
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return _dumps(doc)


class _EndOfTurn(logging.StreamHandler):
    """On the event loop's thread: records kept until the loop turn ends, then formatted and
    written in one write. Elsewhere (worker threads, no loop): written at once."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._pending: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            super().emit(record)
            return
        if not self._pending:
            loop.call_soon(self._write_pending)
        self._pending.append(record)

    def _write_pending(self) -> None:
        records, self._pending = self._pending, []
        if not records:
            return
        try:
            text = "".join(f"{self.format(r)}\n" for r in records)
            with self.lock:  # type: ignore[union-attr] - created by Handler.__init__
                self.stream.write(text)
                self.stream.flush()
        except Exception:
            self.handleError(records[0])

    def flush(self) -> None:
        """Also what is kept (logging.shutdown at exit calls this)."""
        self._write_pending()
        super().flush()


def setup_logging(level: str = "INFO") -> None:
    logging._srcfile = None  # type: ignore[attr-defined] - no caller lookup per record (HOWTO "Optimization")
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if hasattr(logging, "logAsyncioTasks"):
        logging.logAsyncioTasks = False
    handler = _EndOfTurn(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("epd_router")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
