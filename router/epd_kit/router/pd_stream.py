"""Reading a PD's server-sent events (docs/contract.md §3.3) into `data:` payloads, bounded
and linear.

A line may end in LF or CRLF (both valid SSE; a lone CR is not taken as a line end); an event
ends at a blank line; its `data:` lines are joined with LF (other fields and comments are
ignored); `data: [DONE]` ends the stream and sets `done`. A line or an event longer than
`MAX_EVENT_BYTES` is an invalid answer of the engine (`upstream.bad_body`), not a buffer that
grows with whatever the engine sends. The buffer is scanned once: a line that arrives in many
chunks is neither searched again from its start nor copied per chunk (a 300 MB line without a
newline used to be). The chunks come from engine_http's flow-controlled reader, in
blocks of at most 256 KiB, so the check runs before the buffer passes about 1.25 MiB, however
fast the PD sends (a burst used to arrive joined into one block).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from epd_kit.router import upstream
from epd_kit.router.pools import Engine

# vLLM's biggest stream events are a chunk's token ids with their logprobs: far below this
MAX_EVENT_BYTES = 1 << 20


class SseReader:
    """The payloads of one PD stream, as an async iterator; `done` once `[DONE]` came."""

    def __init__(self, chunks: AsyncIterator[bytes], engine: Engine, max_bytes: int = MAX_EVENT_BYTES) -> None:
        self._chunks = chunks
        self._engine = engine
        self._max = max_bytes
        self._buf = bytearray()
        self._pos = 0  # start of the first line not consumed yet
        self._scanned = 0  # no LF in _buf[_pos:_scanned]
        self._data: list[bytes] = []
        self._size = 0  # bytes in _data
        self.done = False

    def __aiter__(self) -> SseReader:
        return self

    async def __anext__(self) -> bytes:
        while not self.done:
            payload = self._next_event()
            if payload is not None:
                if payload == b"[DONE]":
                    self.done = True
                    break
                return payload
            chunk = await anext(self._chunks, None)
            if chunk is None:
                break
            if self._pos:  # drop consumed lines before growing: the buffer holds one partial line
                del self._buf[: self._pos]
                self._scanned -= self._pos
                self._pos = 0
            self._buf += chunk
        raise StopAsyncIteration

    def _next_event(self) -> bytes | None:
        """The payload of the next complete event in the buffer, if there is one."""
        buf = self._buf
        while True:
            end = buf.find(b"\n", max(self._pos, self._scanned))
            if end < 0:
                self._scanned = len(buf)
                if len(buf) - self._pos > self._max:
                    raise upstream.bad_body(self._engine, f"a stream line longer than {self._max} bytes")
                return None
            line = bytes(buf[self._pos : end - 1 if end > self._pos and buf[end - 1] == 13 else end])
            self._pos = self._scanned = end + 1
            if not line:  # the blank line that ends an event
                if self._data:
                    payload = b"\n".join(self._data)
                    self._data, self._size = [], 0
                    return payload
                continue
            if line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                self._size += len(value)
                if self._size > self._max:
                    raise upstream.bad_body(self._engine, f"a stream event longer than {self._max} bytes")
                self._data.append(value)
