"""Errors a simulated engine answers with, in vLLM's ErrorResponse shape."""

from __future__ import annotations


class RequestRejected(Exception):
    """A request the engine refuses; the engine itself stays healthy."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


class ECLoadFailure(Exception):
    """PD could not load an embedding from a VE: kills the PD engine core (tutorial)."""

    def __init__(self, mm_hashes: list[str], cause: str = "") -> None:
        self.mm_hashes = mm_hashes
        self.cause = cause
        super().__init__(f"Encoder-cache load failed for mm_hashes: {mm_hashes}")


class EngineDeadError(Exception):
    """The engine core died; every request fails until the process is restarted."""
