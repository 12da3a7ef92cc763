"""A streaming client that stops reading is its own problem, never its PD's: a real router in
front of one sim PD; raw-socket clients with a small receive buffer (SO_RCVBUF) send a long
stream request and then read nothing for longer than `timeouts.stream_gap_s`, so the router's
writes to them wait on TCP. The router must not take that wait for a stalled PD (it used to:
every such stream charged the PD with a timeout, and `failure_threshold` of them ejected it,
so anyone could eject PDs by opening streams and not reading). A client that resumes reading
gets its whole answer; one that never does is dropped after `listen.idle_timeout_s` without
a charge; another client is served throughout.

Every loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx

from .harness import HOST, Stack, wait_until

GAP_S = 1.0  # timeouts.stream_gap_s
IDLE_S = 4.0  # listen.idle_timeout_s: how long a write to the client may wait
STALL_S = 2.5  # a client's pause: longer than the PD gap, shorter than its own bound
# ignore_eos: the stream is long enough (~1 MB of frames) to fill the router's buffers
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "tell me a very long story"}],
    "max_tokens": 6000,
    "ignore_eos": True,
    "stream": True,
}


def _open_stalled_stream(port: int) -> socket.socket:
    """A stream request from a socket with a small receive buffer; nothing is read yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # before connect: a small window, and a small MSS, which keeps the router's send buffer
    # small too (Linux grows it per segment: on loopback, 64 KiB segments make it 4 MiB)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(IDLE_S + 10)
    sock.connect((HOST, port))
    body = json.dumps(BODY).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read_to_end(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything until the router closes (bounded by `limit_s`) and whether it reset."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
    except ConnectionResetError:
        return b"".join(chunks), True
    raise AssertionError(f"the router kept the connection open for more than {limit_s}s")


def _dechunk(body: bytes) -> bytes:
    """A chunked body's payload (the router streams with Transfer-Encoding: chunked)."""
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


def _served(url: str) -> bool:
    body = {**BODY, "max_tokens": 4, "ignore_eos": False, "stream": False}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10, trust_env=False)
    return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])


def test_a_client_that_stops_reading_is_not_charged_to_its_pd(ckpt, tmp_path):
    stack = Stack.start(
        ckpt,
        tmp_path,
        n_ve=1,
        n_pd=1,
        timeouts={"stream_gap_s": GAP_S},
        listen={"idle_timeout_s": IDLE_S},
        retries={"max_attempts": 1},
    )
    try:
        router = stack.router
        # failure_threshold (2) paused streams: before the fix each was a PD timeout, the
        # second ejected the only PD
        paused = [_open_stalled_stream(router.port) for _ in range(2)]
        time.sleep(STALL_S)
        assert _served(router.url)  # another client, during the pause
        with concurrent.futures.ThreadPoolExecutor(len(paused)) as readers:  # both resume at once
            answers = list(readers.map(lambda sock: _read_to_end(sock, 30)[0], paused))
        for sock in paused:
            sock.close()
        for raw in answers:
            head, _, chunked = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            body = _dechunk(chunked)
            assert b'"error"' not in body, body[-400:]
            assert body.rstrip().endswith(b"data: [DONE]"), body[-400:]
        pd = router.pools()["epd-pd-0"]
        assert pd["healthy"] is True and pd["failures"] == 0, pd
        assert pd["last_error"] in (None, ""), pd

        # clients that never read again: dropped after their own bound (their PD slots freed
        # while they still read nothing), the PD not charged
        gone = [_open_stalled_stream(router.port) for _ in range(2)]
        time.sleep(IDLE_S)
        wait_until(lambda: router.pools()["epd-pd-0"]["inflight"] == 0, 5, "the slow clients dropped")
        # their connections are closed at once, not after a flush they would never take: they
        # hold no place under listen.max_connections while they still read nothing
        wait_until(
            lambda: (
                'reason="write_stalled"} 2.0' in httpx.get(router.url + "/metrics", timeout=5, trust_env=False).text
            ),
            5,
            "both stalled connections closed",
        )
        pd = router.pools()["epd-pd-0"]
        assert pd["healthy"] is True and pd["failures"] == 0, pd
        for sock in gone:
            with sock:
                raw, _ = _read_to_end(sock, 10)  # what the router had written, then the close
            body = _dechunk(raw.partition(b"\r\n\r\n")[2])
            assert b"[DONE]" not in body and b'"error"' not in body, body[-400:]
        assert _served(router.url)
        metrics = httpx.get(router.url + "/metrics", timeout=5, trust_env=False).text
        assert 'status="stream_error"' not in metrics
        log = router.log()
        assert "Traceback" not in log and "no token in the stream" not in log
    finally:
        stack.stop()
