"""Signals that arrive before the server is up (kept import-light on purpose)."""

from __future__ import annotations

import signal


class EarlySignals:
    """Records SIGHUP/SIGTERM/SIGINT that arrive while the router is still importing and
    loading the checkpoint (systemd `Type=exec` may send a reload that early); the server
    replays them once its own handlers are installed instead of dying or losing a reload."""

    SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> EarlySignals:
        for sig in self.SIGNALS:
            signal.signal(sig, self._record)
        return self

    def _record(self, sig: int, frame: object) -> None:
        self.received.append(sig)
