"""The client-facing HTTP/1.1 listener: uvicorn's httptools protocol plus the limits uvicorn
does not enforce. It subclasses uvicorn's HttpToolsProtocol and uses its internals (cycle,
flow, parser, connections, shutdown), so pyproject.toml bounds uvicorn to the releases it was
measured with, 0.54 and 0.55 (tests/unit/router/test_router_listener.py fails on any other).
TLS (listen.tls) is uvicorn's `Config.ssl`, under this protocol: nothing here changes with it.
In uvicorn 0.54 and 0.55 there is no header or body timeout (a half-sent head or a
short body holds a connection forever), a fresh connection that never sends stays open, and
`limit_concurrency` counts requests, not sockets. So, per connection (`listen` settings):

- header timeout: from the connection, or from the first byte of the next request on a
  kept-alive one, to the end of the request head -> 408 and close;
- body timeout: from the end of the head to the end of the body -> 408 and close (the app
  sees the client leave: a quiet 499 in its log);
- idle timeout: uvicorn's keep-alive timer (`timeout_keep_alive`);
- connection cap: a connection beyond `max_connections` gets a 503 with Retry-After, closed;
- head size: a request head over `MAX_HEAD_BYTES` -> 400 and close (h11 had this cap built
  in; llhttp has none, so a header flood would grow memory until the header timeout),
  however the head arrives: counted per received chunk while it is incomplete, and per
  parsed URL and header (a whole head in one write never shows as incomplete);
- `Upgrade`: ignored, as RFC 9110 §7.8 lets a server do (the router takes no protocol
  upgrade; uvicorn's websockets are off). httptools treats a request with `Connection:
  upgrade` as having no body, so the body is read here (`Content-Length` bytes after the
  head), the request is served as plain HTTP/1.1, and what follows is parsed afresh;
- transfer coding: anything but `chunked` -> 501 and close (RFC 9112 §6.1: a server that does
  not understand a transfer coding should answer 501);
- a malformed request gets uvicorn's 400 as the router's JSON error envelope;
- a body that still arrives after its request was answered (a 401 or a tenant's 429 is sent
  before the body is read) is dropped up to `MAX_DISCARD_BYTES`, then the connection is
  closed (`unread_body`): a refused request costs no more reading than that;
- shutdown (uvicorn's at exit, or a process of a group that stops accepting): a connection
  whose first request head is not complete yet is not reset, since that request may already
  be on the wire; it is served and closed after its response (or at its header timeout). The
  same holds for a kept-alive connection whose next request has begun to arrive, or waits
  unread in the socket (a loaded event loop reads it late): closing it would drop a request
  the client already sent. A kept-alive connection with nothing arriving closes at once at
  uvicorn's exit; when a process of a group hands the shared listener over (server.py), it
  closes only once it has been idle `drain_linger_s` (`shutdown(linger_s)`), since a client may
  have just taken it from its pool: a request sent meanwhile is answered with `Connection:
  close` and the connection closed after it (issue 55: a request reset during a roll).

For the app's race against a client that leaves (routes.py `_race_disconnect`), each request's
scope carries a `DisconnectSignal` (`CLIENT_GONE`) that fires when uvicorn marks the request's
cycle disconnected, which is when its `receive()` would answer `http.disconnect`: the app
learns it without a task of its own per request waiting on `receive()`.

Each close is counted (`epd_router_client_connections_closed_total{reason}`); no log line
per connection, so a flood of slow clients cannot flood the journal.

httptools (llhttp, C) rather than h11 (pure Python): a quarter of the server's CPU per request
(docs/dependencies.md has the figures).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import uuid
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from epd_kit.router.errors import RouterError
from epd_kit.router_yaml import Listen

log = logging.getLogger("epd_router.listener")

_REASONS = {408: "Request Timeout", 400: "Bad Request", 501: "Not Implemented", 503: "Service Unavailable"}

# the scope key of a request's DisconnectSignal
CLIENT_GONE = "epd.client_gone"

# the request head cap uvicorn's h11 protocol applied (h11_max_incomplete_event_size)
MAX_HEAD_BYTES = 16 * 1024

# The most of a request's body read after its answer was sent without it (a 401 or a tenant's
# 429 comes before the body): uvicorn reads and drops the rest to keep the connection, which
# cost 58 MiB of reading after one 429 (issue 58). Past this the connection is closed.
MAX_DISCARD_BYTES = 256 * 1024

# How long the common clients keep an idle connection in their pool: httpx's `Limits`
# (keepalive_expiry=5.0, httpx/_config.py) and the OpenAI Python SDK's, which builds on httpx2
# and leaves it at that default (openai/_constants.py DEFAULT_CONNECTION_LIMITS sets only the
# counts; httpx2/_config.py keepalive_expiry=5.0). httpcore counts it from the moment the
# response was read (`_response_closed` sets `_expire_at`) and checks it when a request takes a
# connection from the pool (`has_expired`, and a FIN already received), so a connection idle
# longer than this is never sent on by them. No source found here settles HAProxy's pooled
# server connections (docs/router.md: HAProxy resends on `retry-on empty-response` anyway).
CLIENT_KEEPALIVE_S = 5.0
# What a draining process of a group waits on top of that before closing an idle kept-alive
# connection: the client's delay between taking the connection and sending on it, and between
# the response's last byte and the client reading it, scheduling delays of a loaded machine
# (issue 55's run was at load 11 on 2 cores: tens of milliseconds; 2 s is far past them). Each
# second counts: the linger adds to a process's stop, and so to every step of a roll, while a
# client (HAProxy's pool among them) holds a connection it used less than the linger before.
DRAIN_LINGER_MARGIN_S = 2.0


def drain_linger_s(listen: Listen, shutdown_grace_s: float) -> float:
    """How long a process handing the shared listener over keeps an idle kept-alive connection:
    past the clients' keep-alive, never past the idle timeout (which closes it anyway), and at
    most half the shutdown grace, so a request that comes at the linger's end still has the
    other half to be answered before the grace runs out."""
    return min(CLIENT_KEEPALIVE_S + DRAIN_LINGER_MARGIN_S, listen.idle_timeout_s, shutdown_grace_s / 2)


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the event loop has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:  # closed meanwhile
        return 0


def raw_response(error: RouterError) -> bytes:
    """A complete `Connection: close` response with the error envelope, written straight to
    the socket (there may be no request the parser could answer)."""
    body = error.body(uuid.uuid4().hex)
    headers = [
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in error.headers(None).items()),
    ]
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + body


class DisconnectSignal:
    """Tells one request's app that its client left (see the module docstring), and lets the
    app drop a client that stopped reading (`drop`)."""

    __slots__ = ("_callback", "_drop", "_flow", "_soon", "gone")

    def __init__(self, flow: Any, drop: Callable[[], None]) -> None:
        self._flow = flow
        self._drop = drop
        self._callback: Callable[[], None] | None = None
        self._soon: asyncio.Handle | None = None
        self.gone = False

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the client is gone: from the loop's next turn if it is gone
        already (when a task waiting on `receive()` would have learnt it), else as the
        connection is lost."""
        self._flow.resume_reading()  # what uvicorn's receive() does while an app waits on it
        if self.gone:
            self._soon = asyncio.get_running_loop().call_soon(callback)
        else:
            self._callback = callback

    def unwatch(self) -> None:
        self._callback = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None

    def drop(self) -> None:
        """Close the connection of a client that stopped reading without waiting for it to
        take what is buffered: a plain close would flush first, and hold the socket (and its
        place under listen.max_connections) for as long as the client reads nothing."""
        self._drop()

    def fire(self) -> None:
        self.gone = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class GuardedHttpProtocol(HttpToolsProtocol):
    """One client connection; see the module docstring. Built by `protocol_factory`."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        listen: Listen,
        closed: Callable[[str], None],
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._listen = listen
        self._closed = closed
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time at which the phase's limit runs out
        self._phase: str | None = None  # "header" or "body" while a deadline runs
        self._head_bytes = 0  # received while the current head is incomplete
        self._head_parsed = 0  # URL and header bytes of the current head, as parsed
        self._padding = 0  # empty lines before the next request line
        self._in_message = False  # between on_message_begin and on_message_complete
        self._refusal: RouterError | None = None  # why a parser callback stopped the parse
        self._upgrade_body: int | None = None  # body bytes still due after an Upgrade head
        self._shutting_down = False  # close after the response to the request now arriving
        self._discarded = 0  # body bytes dropped after the request's answer

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._listen.max_connections:
            error = RouterError(
                503, f"too many connections (listen.max_connections {self._listen.max_connections})", retry_after=1
            )
            self._close("over_capacity", error)
            return
        self._arm("header", self._listen.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, without its log line per malformed request."""
        if self._upgrade_body is not None:
            self._upgrade_body_received(data)
            return
        self._unset_keepalive_if_required()
        if not self._in_message and self._count_padding(data):
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade_body_received(data[exc.args[0] :])  # not an upgrade here: the body follows
            return
        except Exception:  # a parser error, or a request target uvicorn cannot decode
            if not self.transport.is_closing():
                self._close("malformed", self._refusal or RouterError(400, "malformed HTTP request"))
            return
        if self._phase == "header":  # the head is still incomplete after this chunk
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._close("malformed", _head_too_large())

    def _count_padding(self, data: bytes) -> bool:
        """Empty lines before a request line (RFC 9112 §2.2 lets a server skip them; llhttp
        does, before it calls on_message_begin): they count towards the head's size and start
        its timeout, so padding cannot stream forever past `MAX_HEAD_BYTES`.
        True when the connection was closed for it."""
        pad = len(data) - len(data.lstrip(b"\r\n"))
        if not pad:
            return False
        if self._phase is None:  # the first byte of the next request on a kept-alive connection
            self._arm("header", self._listen.header_timeout_s)
        self._padding += pad
        if self._padding > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._close("malformed", _head_too_large())
            return True
        return False

    def _upgrade_body_received(self, data: bytes) -> None:
        """Bytes after the head of a request with `Connection: upgrade`: its body (which
        httptools does not parse), then whatever the client sent next, for a fresh parser."""
        if self._upgrade_body is None:
            self.parser = httptools.HttpRequestParser(self)
            self._upgrade_body = self._declared_length()
            if self._upgrade_body is None:
                self._close(
                    "malformed", RouterError(400, "a request with Upgrade must send its body with Content-Length")
                )
                return
        take = data[: self._upgrade_body]
        self._upgrade_body -= len(take)
        if take:
            super().on_body(take)
        if self._upgrade_body:
            return
        self._upgrade_body = None
        self.on_message_complete()
        if len(data) > len(take):
            self.data_received(data[len(take) :])

    def _declared_length(self) -> int | None:
        """The Content-Length of the request now arriving (0 without one, None if chunked)."""
        length = 0
        for name, value in self.headers:
            if name == b"content-length" and value.strip().isdigit():
                length = int(value)
            elif name == b"transfer-encoding":
                return None
        return length

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()  # a pending timer would keep this protocol for up to a body timeout
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:  # what makes its receive() say http.disconnect
            signal = cycle.scope.get(CLIENT_GONE)
            if signal is not None:
                signal.fire()

    # --- parser callbacks and uvicorn hooks ------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase is None:  # the first byte of a request on a kept-alive connection
            self._arm("header", self._listen.header_timeout_s)
        self._head_parsed = self._padding  # the padding counts towards the head
        self._padding = 0
        self._discarded = 0
        self._in_message = True
        super().on_message_begin()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is None or not cycle.response_complete or self.parser.should_upgrade():
            super().on_body(body)
            return
        self._discarded += len(body)  # answered already: what uvicorn would drop
        if self._discarded > MAX_DISCARD_BYTES and not self.transport.is_closing():
            self._disarm()
            self._closed("unread_body")
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > MAX_HEAD_BYTES:
            self._refuse(_head_too_large())

    def _refuse(self, error: RouterError) -> None:
        """Stop the parse from inside a parser callback; data_received answers `error`."""
        self._refusal = error
        raise _Refused(error.message)

    def on_headers_complete(self) -> None:
        self._head_bytes = 0
        for name, value in self.headers:
            if name == b"transfer-encoding" and [c.strip() for c in value.lower().split(b",")] != [b"chunked"]:
                coding = value.decode("latin-1")[:100]
                self._refuse(
                    RouterError(
                        501,
                        f"transfer coding {coding!r} is not implemented; send the body with Content-Length "
                        "or Transfer-Encoding: chunked",
                    )
                )
        self.scope[CLIENT_GONE] = DisconnectSignal(self.flow, self._drop_stalled)  # type: ignore[literal-required]
        super().on_headers_complete()
        self.cycle.transport = HeadJoiner(self.transport, self.cycle, self.loop)  # type: ignore[assignment]
        if self._shutting_down and self.cycle is not None:
            self.cycle.keep_alive = False
        self._arm("body", self._listen.body_timeout_s)  # disarmed at once when there is none

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade():  # the body comes after: _upgrade_body_received
            return
        self._in_message = False
        self._disarm()  # the request is in; answering is the app's business
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self._close("malformed", RouterError(400, f"malformed HTTP request: {msg}"))

    def shutdown(self, linger_s: float = 0.0) -> None:
        """uvicorn's at exit (no argument), or a group's hand-over with `drain_linger_s`."""
        # see the module docstring; the socket is asked only between requests
        arriving = self.cycle is None or (
            self.cycle.response_complete and (self._phase == "header" or _unread_bytes(self.transport) > 0)
        )
        if arriving:
            self._shutting_down = True
            return
        if linger_s > 0 and self.cycle.response_complete and self._linger(linger_s):
            return
        joiner = self.cycle.transport if self.cycle is not None else None
        if isinstance(joiner, HeadJoiner):  # a head held for this turn (a HEAD's) before the close
            joiner.flush()
        super().shutdown()

    def _linger(self, linger_s: float) -> bool:
        """Keep an idle kept-alive connection until it has been idle `linger_s`: uvicorn's
        keep-alive timer, armed when the response completed, is moved to then (a request that
        arrives cancels it, as any; its response closes the connection). False when it has been
        idle that long already, or no timer runs (the connection is closing)."""
        timer = self.timeout_keep_alive_task
        if timer is None:
            return False
        close_at = timer.when() - self.timeout_keep_alive + linger_s  # idle since + linger
        if close_at <= self.loop.time():
            return False
        self._shutting_down = True
        if close_at < timer.when():
            timer.cancel()
            self.timeout_keep_alive_task = self.loop.call_at(close_at, self.timeout_keep_alive_handler)
        return True

    # --- deadlines -----------------------------------------------------------------------

    # One timer per connection, not one per phase: a phase's deadline only moves `_deadline`,
    # and the timer is replaced only when the new deadline comes before it would fire; one that
    # fires early re-arms for the rest (the header and body timers of every request were three
    # timer starts and cancels per request, ~2 % of a text request's CPU: docs/benchmarks.md
    # "Issue 58 item 6"). The deadlines hold exactly as before.

    def _arm(self, phase: str, seconds: float) -> None:
        self._phase = phase
        self._deadline = deadline = self.loop.time() + seconds
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return  # it fires first and re-arms for the rest
            timer.cancel()
        self._timer = self.loop.call_at(deadline, self._expired)

    def _disarm(self) -> None:
        """No deadline runs (a pending timer finds none when it fires)."""
        self._phase = None

    def _stop_timer(self) -> None:
        self._phase = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        phase = self._phase
        if phase is None:
            return
        if self.loop.time() < self._deadline:  # armed for an earlier deadline since replaced
            self._timer = self.loop.call_at(self._deadline, self._expired)
            return
        self._phase = None
        if self.transport.is_closing():
            return
        limit = self._listen.header_timeout_s if phase == "header" else self._listen.body_timeout_s
        what = "the request headers" if phase == "header" else "the request body"
        error = RouterError(408, f"{what} did not arrive within {limit:g}s (listen.{phase}_timeout_s)")
        # a response under way cannot take a 408 in its middle; the previous request's
        # finished one (a kept-alive connection's next head trickling in) can
        cycle = self.cycle
        started = cycle is not None and cycle.response_started and not cycle.response_complete
        self._close(f"{phase}_timeout", None if started else error)

    def _drop_stalled(self) -> None:
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            self._disarm()
            self._closed("write_stalled")
            self.transport.abort()

    def _close(self, reason: str, error: RouterError | None) -> None:
        self._disarm()
        self._closed(reason)
        if error is not None:
            self.transport.write(raw_response(error))
        self.transport.close()  # uvicorn's connection_lost tells a waiting app the client left


class HeadJoiner:
    """A request cycle's transport that sends the response head with the first piece of the
    body in one write. uvicorn writes the head (`http.response.start`) and the body apart: two
    socket sends and two TCP segments for a one-piece JSON answer, where one does (each send
    is a system call and the loopback's delivery to the client, on the router's CPU; about
    5 % of a text request's CPU, docs/benchmarks.md "Issue 58 item 6"). The head is held only
    until the body's first write or the end of the event loop's turn, whichever comes first
    (a stream whose first frame is not ready gets its head at once, as before); a close sends
    it first, an abort drops it with the connection. Other writes (the `100 Continue` of
    `receive()`) pass straight through."""

    __slots__ = ("_cycle", "_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._cycle = cycle  # until the head is written (then dropped: no reference cycle kept)
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
            return
        cycle = self._cycle
        if cycle is not None and cycle.response_started:  # the head: uvicorn writes it right after
            self._cycle = None
            self._head = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Refused(Exception):
    """Raised in a parser callback to stop the parse (httptools re-raises it from feed_data)."""


def _head_too_large() -> RouterError:
    return RouterError(400, f"malformed HTTP request: request head over {MAX_HEAD_BYTES // 1024} KiB")


def protocol_factory(listen: Listen, closed: Callable[[str], None]) -> Callable[..., GuardedHttpProtocol]:
    """What `uvicorn.Config(http=...)` takes: uvicorn calls it with its own arguments."""

    def make(*args: Any, **kwargs: Any) -> GuardedHttpProtocol:
        return GuardedHttpProtocol(*args, listen=listen, closed=closed, **kwargs)

    return make
