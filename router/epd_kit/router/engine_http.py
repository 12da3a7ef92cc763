"""The router's HTTP/1.1 client to the engines: `POST` with a `Content-Length` body, the answer
read whole (`EngineHTTP.post`) or as it arrives (`EngineHTTP.open`, for SSE streams), on
kept-alive connections pooled per engine origin. Built on `asyncio.Protocol` and httptools
(llhttp, C: the parser the router's listener already uses): 58 k instructions per POST with
its answer (docs/notes/2026-12-01-peers-at-info-issue-23.md, "Item 7, second round" has the
clients it replaced and why).
Only what the engine calls need: no
redirects, cookies, proxies, TLS or compression (nothing asks for it: no `Accept-Encoding`
is sent, and a body an engine encodes anyway is handed on as received).

Errors are named for what went wrong; upstream.classify_exception sorts them:

- `CannotConnect` (a `ConnectionBroken`): the dial failed (refused, unreachable, DNS);
- `ConnectTimeout` (an `EngineTimeout`): no connection within `connect_s`;
- `ReadTimeout` (an `EngineTimeout`): no byte for `read_s` while an answer is due (each byte
  received restarts it: a backstop behind the caller's deadline);
- `ClosedBeforeAnswer`: the engine closed the connection before any byte of the answer
  (the one failure after which a resend on a fresh connection is safe to try: engine_client);
- `ConnectionBroken`: the connection broke with an OS error (a reset) before the answer's head;
- `AnswerCutShort`: the connection ended inside the answer (cut short head or body);
- `NotAnAnswer`: bytes that are not an HTTP/1.1 answer; `AnswerTooLarge`, one of them: a
  head over `MAX_HEAD_BYTES` or `MAX_HEADERS`, a body over the call's `max_body`;
- `ConnectionFailed`: the answer was closed by our side (`Response.close`) while a read
  waited on it.

`EngineTimeout` is also a `TimeoutError`: callers catch `EngineCallError`
before `TimeoutError`. A call may also carry a `deadline` (a loop time) for the whole call,
dial and answer included; past it the call fails with `DeadlineExceeded`, a `TimeoutError`
and not an `EngineCallError`: what an `asyncio.timeout` around the call would raise, without the
cost of one (the call's own read timer watches both).

Nothing an engine sends is trusted to be small: the head (interim answers included) is
capped before llhttp joins its lines (httptools joins a header split across reads by
concatenation: 16 MB of one header in 64 KiB reads took 3.4 s of the event loop), and a body
read whole is capped by the caller (`max_body`: /health, non-streaming answers). Interim
answers (`100 Continue`, `103 Early Hints`) are skipped: the call reads the final one.

A body read as it arrives (`iter_any`, a stream) is flow-controlled as `asyncio.StreamReader`
is: once more than `HIGH_WATER` bytes wait for the reader, the connection stops reading
(`transport.pause_reading`; the engine's writes then wait on TCP), and it reads again when
the reader has taken them down to `LOW_WATER`. A flooding engine in front of a slow client
costs the router at most those bytes and one socket read per stream, and the reader gets
blocks of at most `HIGH_WATER` bytes (each chunk as received, joined only up to it), so a
burst is never one block before the stream's line check (pd_stream.py). The read timeout
does not run while reading is paused: the engine is not late, the reader is.

A connection goes back to its pool only after a complete answer that allows keep-alive;
every other end (an error, a cancelled call, a stream closed before its end) closes it. An
idle connection is kept `keepalive_s`, then closed; one the engine closed while idle is
dropped when the pool next looks at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from epd_kit.router.engine_keys import EngineKeys
from epd_kit.router.tracing import engine_headers

# --- errors: what went wrong with an engine call -------------------------------------------


class EngineCallError(Exception):
    """Any failure of an engine call in this client."""


class ConnectionFailed(EngineCallError):
    """The connection failed or was closed (by our side: `Response.close`, `EngineHTTP.close`)."""


class ConnectionBroken(ConnectionFailed, OSError):
    """The connection broke with an OS error (a reset) before the answer's head."""


class CannotConnect(ConnectionBroken):
    """The dial failed (refused, unreachable, a name that does not resolve)."""


class ClosedBeforeAnswer(ConnectionFailed):
    """The engine closed the connection before any byte of the answer."""

    def __init__(self, message: str = "the engine closed the connection before answering") -> None:
        super().__init__(message)


class EngineTimeout(ConnectionFailed, TimeoutError):
    """A timer of this client ran out (connect_s or read_s)."""


class ConnectTimeout(EngineTimeout):
    """No connection within connect_s."""


class ReadTimeout(EngineTimeout):
    """No byte for read_s while an answer is due."""


class AnswerCutShort(EngineCallError):
    """The connection ended inside the answer (head or body)."""


class NotAnAnswer(EngineCallError):
    """Bytes that are not an HTTP/1.1 answer."""


class AnswerTooLarge(NotAnAnswer):
    """An answer over a size cap (head bytes, header count, body): refused, not read on."""


# An engine's answer head, interim answers included: vLLM's uvicorn sends a few hundred bytes
# (h11's own cap on an incomplete head is 16 KiB); anything near these is not an engine.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100

# A streamed body's flow control (the module docstring): asyncio.StreamReader's default
# limit is 64 KiB and it pauses above twice that; one socket read is at most 256 KiB
# (asyncio's selector transport), so a stream holds at most about HIGH_WATER + 256 KiB here
HIGH_WATER = 128 * 1024
LOW_WATER = 64 * 1024


class DeadlineExceeded(TimeoutError):
    """The call's own `deadline` passed (see the module docstring): not an HTTP failure."""


# --- request bodies ----------------------------------------------------------------------


class ChunkedBody(Protocol):
    """A body sent as several byte chunks, one after the other, without joining them
    (bodies.VeBody: the multi-megabyte items are the cached bytes themselves)."""

    chunks: tuple[bytes, ...]
    size: int


class RawHeaders(Mapping[str, str]):
    """An answer's headers as received; lookups ignore case. Built lazily: the success path
    reads none."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> str:
        key = name.lower().encode("latin-1")
        for k, v in self._raw:
            if k.lower() == key:
                return v.decode("latin-1")
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k.decode("latin-1").lower() for k, _ in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


# what a waiting reader needs before it is woken
_WANT_COMPLETE, _WANT_HEAD, _WANT_DATA = 0, 1, 2


class Response:
    """One answer on one connection: its status and headers once the head is read, its body
    read whole (`read`) or as it arrives (`iter_any`). `release` hands a fully read answer's
    connection back to the pool; `close` drops the connection (a stream cut short)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_exc",
        "_head",
        "_interim",
        "_max_body",
        "_raw_headers",
        "_released",
        "_size",
        "_waiter",
        "_want",
        "_whole",
        "complete",
        "got_bytes",
        "status",
    )

    def __init__(self, conn: _Connection, max_body: float = math.inf) -> None:
        self._conn = conn
        self._max_body = max_body
        self._size = 0
        self._interim = False
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._buffered = 0  # bytes in _chunks
        self._whole = False  # read whole (`read`): never paused, `max_body` bounds it
        self._head = False
        self.complete = False
        self.got_bytes = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._want = _WANT_COMPLETE
        self._released = False

    @property
    def headers(self) -> RawHeaders:
        return RawHeaders(self._raw_headers)

    # --- reading ---------------------------------------------------------------------------

    async def _wait(self, want: int) -> None:
        self._want = want
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self, level: int) -> None:
        waiter = self._waiter
        if waiter is not None and level >= self._want and not waiter.done():
            waiter.set_result(None)

    async def wait_head(self) -> None:
        while not self._head:
            if self._exc is not None:
                raise self._exc
            await self._wait(_WANT_HEAD)

    async def read(self, max_body: float = math.inf) -> bytes:
        """The whole body (what is left of it), once the answer is complete. `max_body`
        lowers the call's cap (an error answer on a stream: its body is read whole)."""
        if max_body < self._max_body:
            self._max_body = max_body
            if self._size > max_body:
                self._refuse(f"the engine's answer is longer than the {max_body:.0f} bytes read")
        self._whole = True
        self._conn.resume_reading()  # the cap bounds a body read whole, not the reader's pace
        while not self.complete:
            if self._exc is not None:
                raise self._exc
            await self._wait(_WANT_COMPLETE)
        chunks = self._chunks
        self._chunks = []
        self._buffered = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, until the answer is complete: blocks of at most
        `HIGH_WATER` bytes (or one chunk as received, if it is longer), flow-controlled
        (the module docstring)."""
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self.complete:
                return
            if self._exc is not None:
                raise self._exc
            await self._wait(_WANT_DATA)

    def _take(self) -> bytes:
        """The buffered chunks from the front, joined up to HIGH_WATER bytes; reading
        resumes once what is left is at most LOW_WATER."""
        chunks = self._chunks
        if self._buffered <= HIGH_WATER:
            n, size = len(chunks), self._buffered
        else:
            n, size = 1, len(chunks[0])
            while n < len(chunks) and size + len(chunks[n]) <= HIGH_WATER:
                size += len(chunks[n])
                n += 1
        block = chunks[0] if n == 1 else b"".join(chunks[:n])
        del chunks[:n]
        self._buffered -= size
        if self._buffered <= LOW_WATER:
            self._conn.resume_reading()
        return block

    # --- ending ----------------------------------------------------------------------------

    def release(self) -> None:
        """Done with the answer: a complete one's connection goes back to the pool (if the
        engine keeps it alive), any other is closed, so the engine sees the request end."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if self.complete and self._exc is None:
            conn.done(self)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection; a read waiting on this answer fails with
        `ConnectionFailed`."""
        self._released = True
        if not self.complete:
            self._fail(ConnectionFailed("the answer was closed while a read waited on it"))
        self._conn.close()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self.complete:
            self._exc = exc
            self._conn.stop_timer()
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    # --- httptools callbacks (through the connection) --------------------------------------

    def _headers_complete(self, status: int) -> None:
        if 100 <= status < 200:  # interim (101 is an upgrade: llhttp refuses it)
            self._interim = True
            self._raw_headers.clear()
            return
        self.status = status
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > self._max_body:
            self._refuse(f"the engine's answer declares {length} bytes, above the {self._max_body:.0f} read")
            return
        self._head = True
        self._wake(_WANT_HEAD)

    def _body(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._max_body:
            self._refuse(f"the engine's answer is longer than the {self._max_body:.0f} bytes read")
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._whole:
            self._conn.pause_reading()  # the reader is behind: let TCP hold the rest
        self._wake(_WANT_DATA)

    def _refuse(self, why: str) -> None:
        self._chunks = []
        self._buffered = 0
        self._fail(AnswerTooLarge(why))
        self._conn.close()

    def _message_complete(self) -> bool:
        """False for an interim answer: the final one follows on the same connection."""
        if self._interim:
            self._interim = False
            return False
        self.complete = True
        self._conn.stop_timer()
        self._wake(_WANT_COMPLETE)
        return True

    def _reads_until_close(self) -> bool:
        """An answer whose body ends with the connection (no length, not chunked)."""
        if not self._head:
            return False
        for name, value in self._raw_headers:
            lname = name.lower()
            if lname == b"content-length" or (lname == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine; at most one answer in flight on it."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.lost = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._last_data = 0.0
        self._read_s = 0.0
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused = False  # writing: the engine is not reading our request
        self._reading_paused = False  # reading: our reader is behind (Response._body)
        self._head_bytes = 0  # bytes fed to the parser before the final answer's head ended
        self._headers = 0

    # --- the caller's side -----------------------------------------------------------------

    async def send(
        self, head: bytes, content: bytes | ChunkedBody, read_s: float, deadline: float, max_body: float = math.inf
    ) -> Response:
        """Write one request; its answer (`Response`) fills as bytes arrive."""
        self.resume_reading()  # a pooled connection always reads, but be sure
        resp = self.response = Response(self, max_body)
        self._head_bytes = self._headers = 0
        transport = self.transport
        assert transport is not None
        self._read_s = read_s
        self._deadline = deadline
        loop = self.loop
        self._last_data = now = loop.time()
        self._timer = loop.call_at(min(now + read_s, deadline), self._read_check)
        if isinstance(content, bytes):
            transport.write(head + content)
        else:
            chunks = content.chunks
            transport.write(head + chunks[0] if chunks else head)
            for chunk in chunks[1:]:
                if self._paused:
                    await self._drain()
                if self.lost:
                    break  # the answer carries the failure
                transport.write(chunk)
        return resp

    async def _drain(self) -> None:
        if self.lost:
            return  # the answer carries the failure
        self._drained = self.loop.create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    def done(self, resp: Response) -> None:
        """`resp` was read to its end: back to the pool, or closed if it cannot be reused."""
        if self.response is resp:
            self.response = None
        self.resume_reading()  # the answer ended in the read that paused it
        if self.lost or not self.keep_alive:
            self.close()
        else:
            self.pool.put(self)

    def close(self) -> None:
        """Drop the connection: unsent request bytes are discarded (a hung engine that reads
        nothing must not keep the socket), and a send waiting to write more stops."""
        self.stop_timer()
        self.lost = True
        transport = self.transport
        if transport is not None:
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.lost and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self._last_data = self.loop.time()  # the read timeout starts again from here
            if not self.lost and self.transport is not None:
                self.transport.resume_reading()

    def _read_check(self) -> None:
        self._timer = None
        resp = self.response
        if resp is None or resp.complete or resp._exc is not None:
            return
        now = self.loop.time()
        if now >= self._deadline:
            resp._fail(DeadlineExceeded())
            self.close()
            return
        due = self._last_data + self._read_s
        if self._reading_paused:  # the reader is late, not the engine: look again later
            due = max(due, now + self._read_s)
        if now < due:
            self._timer = self.loop.call_at(min(due, self._deadline), self._read_check)
            return
        resp._fail(ReadTimeout("Timeout on reading data from socket"))
        self.close()

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None or resp.complete:  # bytes nobody asked for: the connection is spoilt
            self.close()
            return
        resp.got_bytes = True
        self._last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            resp._fail(NotAnAnswer(f"invalid HTTP response from the engine: {exc}"))
            self.close()
            return
        if not resp._head and resp._exc is None:
            # counted per read, checked after it: llhttp joins at most the cap and one read
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                resp._refuse(f"the engine's answer head is longer than {MAX_HEAD_BYTES} bytes")

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.stop_timer()
        self.pool.forget(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        resp = self.response
        if resp is None or resp.complete or resp._exc is not None:
            return
        if exc is None and resp._reads_until_close():
            resp._message_complete()
        elif not resp.got_bytes:
            resp._fail(ClosedBeforeAnswer() if exc is None else ConnectionBroken(*exc.args))
        else:
            cause = f": {exc!r}" if exc is not None else ""
            resp._fail(AnswerCutShort(f"Response payload is not completed{cause}"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            self.response._refuse(f"the engine's answer has more than {MAX_HEADERS} header lines")  # type: ignore[union-attr]
            raise AnswerTooLarge  # stops the parser (data_received leaves the refusal as it is)
        self.response._raw_headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        self.response._headers_complete(self.parser.get_status_code())  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.response._body(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        # asked now: llhttp resets the message's flags once this callback returns
        keep_alive = self.parser.should_keep_alive()
        if self.response._message_complete():  # type: ignore[union-attr]
            self.keep_alive = keep_alive


class _Pool:
    """The connections to one engine origin: idle ones newest first."""

    def __init__(self, client: EngineHTTP, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"engine URL must be http://host:port, got {url!r}")
        self.client = client
        self.url = url
        self.loop = client.loop
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/")
        self.netloc = parts.netloc
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self._heads: dict[str, bytes] = {}
        self._sweep_timer: asyncio.TimerHandle | None = None

    def head(self, path: str, length: int | None) -> bytes:
        """A POST's head (`length`: its body's), or a GET's (None); with the engine key where
        the engine checks one (engine_keys.py)."""
        auth = self.client.keys.header(self.url, path) + engine_headers()  # and the call's traceparent
        if length is None:
            return f"GET {self.base_path}{path} HTTP/1.1\r\nhost: {self.netloc}\r\n".encode("latin-1") + auth + b"\r\n"
        prefix = self._heads.get(path)
        if prefix is None:
            prefix = self._heads[path] = (
                f"POST {self.base_path}{path} HTTP/1.1\r\nhost: {self.netloc}\r\n"
                "content-type: application/json\r\ncontent-length: "
            ).encode("latin-1")
        return prefix + str(length).encode() + b"\r\n" + auth + b"\r\n"

    async def acquire(self, connect_s: float, fresh: bool, deadline: float) -> _Connection:
        if not fresh:
            idle = self.idle
            if idle:
                oldest_ok = self.loop.time() - self.client.keepalive_s
                while idle:
                    conn = idle.pop()
                    if conn.lost:
                        continue
                    if conn.idle_since < oldest_ok:
                        conn.close()
                        continue
                    return conn
        return await self._dial(connect_s, deadline)

    async def _dial(self, connect_s: float, deadline: float) -> _Connection:
        connect_by = self.loop.time() + connect_s
        try:
            async with asyncio.timeout_at(min(connect_by, deadline)) as limit:
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except TimeoutError:
            if not limit.expired():
                raise
            if deadline <= connect_by:
                raise DeadlineExceeded() from None
            raise ConnectTimeout(f"Connection timeout to host {self.netloc}") from None
        except OSError as exc:
            message = f"Cannot connect to host {self.netloc} [{exc.strerror or exc}]"
            raise CannotConnect(exc.errno, message) from None
        if self.client.closed:
            conn.close()
            raise ConnectionFailed("the client is closed")
        self.open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        if self.client.closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        if self._sweep_timer is None:
            self._sweep_timer = self.loop.call_later(self.client.keepalive_s, self._sweep)

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)

    def _sweep(self) -> None:
        """Close idle connections past their keep-alive; again later while some are idle."""
        self._sweep_timer = None
        oldest_ok = self.loop.time() - self.client.keepalive_s
        keep = []
        for conn in self.idle:
            if conn.lost:
                continue
            if conn.idle_since <= oldest_ok:
                conn.close()
            else:
                keep.append(conn)
        self.idle[:] = keep
        if keep:
            due = keep[0].idle_since + self.client.keepalive_s
            self._sweep_timer = self.loop.call_at(due, self._sweep)

    def close(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        self.idle.clear()
        for conn in list(self.open):
            conn.close()


class EngineHTTP:
    """The pooled client: one per router process, used from its event loop only."""

    def __init__(self, keepalive_s: float, keys: EngineKeys | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.keepalive_s = keepalive_s
        # the engine key each request carries (engine_keys.py); replaced on a reload
        self.keys = keys or EngineKeys()
        self.closed = False
        self._pools: dict[str, _Pool] = {}

    def _pool(self, url: str) -> _Pool:
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = _Pool(self, url)
        return pool

    async def open(
        self,
        url: str,
        path: str,
        content: bytes | ChunkedBody,
        *,
        connect_s: float,
        read_s: float,
        fresh: bool = False,
        deadline: float = math.inf,
        max_body: float = math.inf,
    ) -> Response:
        """POST `content` (JSON) to `url` + `path`; the answer with its head read. The caller
        reads it and then `release`s or `close`s it. `fresh`: dial a new connection rather
        than reuse an idle one. `deadline`: the loop time by which the call must be done.
        `max_body`: the most body bytes taken (more fail the read with `AnswerTooLarge`)."""
        resp, _ = await self._call(url, path, content, connect_s, read_s, fresh, deadline, max_body, whole=False)
        return resp

    async def post(
        self,
        url: str,
        path: str,
        content: bytes | ChunkedBody,
        *,
        connect_s: float,
        read_s: float,
        fresh: bool = False,
        deadline: float = math.inf,
        max_body: float = math.inf,
    ) -> tuple[Response, bytes]:
        """POST and read the whole answer: the response (released) and its body."""
        resp, body = await self._call(url, path, content, connect_s, read_s, fresh, deadline, max_body, whole=True)
        resp.release()
        return resp, body

    async def get(
        self,
        url: str,
        path: str,
        *,
        connect_s: float,
        read_s: float,
        deadline: float,
        max_body: float,
        fresh: bool = False,
    ) -> tuple[Response, bytes]:
        """GET and read the whole answer (a probe: `/health`), as `post`."""
        resp, body = await self._call(url, path, None, connect_s, read_s, fresh, deadline, max_body, whole=True)
        resp.release()
        return resp, body

    async def _call(
        self,
        url: str,
        path: str,
        content: bytes | ChunkedBody | None,
        connect_s: float,
        read_s: float,
        fresh: bool,
        deadline: float,
        max_body: float,
        *,
        whole: bool,
    ) -> tuple[Response, bytes]:
        """One POST (a GET without `content`) on a pooled connection, read to its head or
        (`whole`) to its end; the connection is closed on any failure or cancellation before
        that."""
        if self.closed:
            raise ConnectionFailed("the client is closed")
        pool = self._pool(url)
        conn = await pool.acquire(connect_s, fresh, deadline)
        if content is None:
            head, content = pool.head(path, None), b""
        else:
            head = pool.head(path, len(content) if isinstance(content, bytes) else content.size)
        try:
            resp = await conn.send(head, content, read_s, deadline, max_body)
            if whole:
                return resp, await resp.read()
            await resp.wait_head()
            return resp, b""
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        """Close every connection; calls after this fail with `ConnectionFailed`."""
        self.closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
