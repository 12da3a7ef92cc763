"""A chat request's way in, before any engine: the limit on requests being preprocessed
(CPU and memory before any engine is involved), and the body read itself (size cap, a client
that leaves). A request enters the limit only once its whole body has arrived: uploads still
on their way are bounded per connection (listen.body_timeout_s, listen.max_connections), so
slow ones cannot take the slots of others. The bytes of bodies still arriving are capped
for the process as a whole at what the limit bounded before (max_requests_preprocessing x
max_body_bytes): a trickle costs nothing toward it. Decoding the body is body.py."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

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
    """At most `limits.max_requests_preprocessing` requests between a complete body and the
    end of rendering; one more gets a 429 at once."""

    def __init__(self) -> None:
        self.active = 0
        self.receiving_bytes = 0  # buffered by bodies not yet complete

    def enter(self, limit: int) -> IntakeSlot:
        if self.active >= limit:
            raise RouterError(
                429,
                f"overloaded: {limit} requests are already being preprocessed (limits.max_requests_preprocessing)",
                retry_after=1,
            )
        self.active += 1
        return IntakeSlot(self)


async def read_body(request: Request, limit: int, gate: IntakeGate | None = None, receiving_cap: int = 0) -> bytearray:
    """The whole body, refused (413) as soon as it is known to exceed `limit`. Collected in
    one growing buffer: no final copy of up to `limit` bytes on the event loop. With `gate`,
    its bytes count toward `gate.receiving_bytes` until it is complete, capped at
    `receiving_cap` (a 503)."""
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
            if gate is not None:
                if gate.receiving_bytes + len(chunk) > receiving_cap:
                    raise RouterError(
                        503,
                        f"overloaded: {gate.receiving_bytes} bytes of request bodies are arriving "
                        "(at most limits.max_requests_preprocessing x limits.max_body_bytes)",
                        retry_after=1,
                    )
                gate.receiving_bytes += len(chunk)
            body += chunk
    except ClientDisconnect:
        raise ClientGone from None
    finally:
        if gate is not None:
            gate.receiving_bytes -= len(body)
    return body
