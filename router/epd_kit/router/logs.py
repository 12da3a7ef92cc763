"""Structured logs: one JSON object per line, with the request id when there is one.

Callers pass context through `extra={...}`; secrets and image data are never put there.

Cheap enough for one line per request at INFO (the deployed level): the event loop only
makes the record and puts it on a queue; a writer thread formats and writes it (a slow
journal never holds up a request). Records skip what the lines do not show: the caller's
frame, thread, process and task names (the Logging HOWTO's "Optimization" switches).
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import time

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}

_writer: list[logging.handlers.QueueListener] = []  # the running writer thread, if any


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
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # rendered by _Enqueue
            doc["exc"] = record.exc_text
        return json.dumps(doc, default=str)


class _Enqueue(logging.handlers.QueueHandler):
    """Puts the record as it is on the queue: formatting is the writer thread's job (the
    stock QueueHandler formats in the caller). A traceback is rendered here, while the
    exception is still live."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record


def setup_logging(level: str = "INFO") -> None:
    logging._srcfile = None  # type: ignore[attr-defined] - no caller lookup per record (HOWTO "Optimization")
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if hasattr(logging, "logAsyncioTasks"):
        logging.logAsyncioTasks = False
    stop_logging()
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(JsonFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, writer)
    listener.start()
    _writer.append(listener)
    atexit.register(stop_logging)
    root = logging.getLogger("epd_router")
    root.handlers[:] = [_Enqueue(records)]
    root.setLevel(level)
    root.propagate = False


def stop_logging() -> None:
    """Write what is queued and stop the writer thread (at exit; idempotent)."""
    while _writer:
        _writer.pop().stop()
