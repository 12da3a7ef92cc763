"""A chat request's way in, before any engine: the limit on requests that are receiving
their body or being preprocessed (memory and CPU before any engine is involved), and the body
read itself (size cap, a client that leaves). Decoding the body is body.py."""

from __future__ import annotations

from fastapi import Request
from starlette.requests import ClientDisconnect

from epd_kit.router.errors import RouterError


class ClientGone(Exception):
    """The client disconnected before the answer (a 499 in the logs, no traceback)."""


class IntakeSlot:
    """One request's place in the limit; `release` is idempotent."""

    def __init__(self, gate: IntakeGate) -> None:
        self._gate: IntakeGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate.active -= 1
            self._gate = None


class IntakeGate:
    """At most `limits.max_requests_preprocessing` requests between arrival and the end of
    rendering; one more gets a 429 at once (before its body is read)."""

    def __init__(self) -> None:
        self.active = 0

    def enter(self, limit: int) -> IntakeSlot:
        if self.active >= limit:
            raise RouterError(
                429,
                f"overloaded: {limit} requests are already being received or preprocessed "
                "(limits.max_requests_preprocessing)",
                retry_after=1,
            )
        self.active += 1
        return IntakeSlot(self)


async def read_body(request: Request, limit: int) -> bytearray:
    """The whole body, refused (413) as soon as it is known to exceed `limit`. Collected in
    one growing buffer: no final copy of up to `limit` bytes on the event loop."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RouterError(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise RouterError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise RouterError(413, f"request body exceeds the limit of {limit} bytes")
            body += chunk
    except ClientDisconnect:
        raise ClientGone from None
    return body
