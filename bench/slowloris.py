"""Slow clients against a running router: many connections that never finish their request
(silent, a head trickled a byte at a time, a body shorter than its Content-Length, a body
trickled a byte at a time), while /health is timed. Done when every one of them is closed by
the router within its documented timeout (`listen.header_timeout_s` for the head,
`listen.body_timeout_s` for the body) and /health stays responsive.

    python -m bench.slowloris                    # starts sims + a router here, 500 connections
    python -m bench.slowloris --url http://127.0.0.1:18800 --connections 100

tests/router_processes/test_hostile.py runs a smaller version. One thread drives every socket; the
run is bounded in connections and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bench.common import emit_summary
from bench.hostile import Probe

KINDS = ("silent", "trickled head", "short body", "trickled body")
TRICKLE_EVERY_S = 0.5
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@dataclass
class Slow:
    kind: str
    sock: socket.socket
    opened: float
    head_done_at: float | None = None  # when the head was complete (body kinds)
    closed_at: float | None = None
    answer: bytes = b""
    next_byte_at: float = 0.0
    sent: int = 0

    @property
    def deadline_from(self) -> float:
        """The moment the router's clock for this connection started."""
        return self.head_done_at if self.head_done_at is not None else self.opened


def _open(host: str, port: int, kind: str) -> Slow:
    sock = socket.create_connection((host, port), timeout=5)
    now = time.monotonic()
    slow = Slow(kind, sock, now, next_byte_at=now + TRICKLE_EVERY_S)
    if kind == "trickled head":
        sock.sendall(HEAD)  # then one more header byte now and then, never the blank line
    elif kind in ("short body", "trickled body"):
        sock.sendall(HEAD + b"Content-Length: 100000\r\n\r\n" + b'{"messages": [')
        slow.head_done_at = time.monotonic()
    sock.setblocking(False)
    return slow


def run(url: str, connections: int, header_timeout_s: float, body_timeout_s: float, slack_s: float = 2.0) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    assert host == "127.0.0.1", "slow clients go to 127.0.0.1 only"
    limit = {k: (body_timeout_s if "body" in k else header_timeout_s) for k in KINDS}
    max_s = max(limit.values()) + slack_s + 10
    probe = Probe(url)
    prober = threading.Thread(target=probe.run, args=(max_s + 30,), daemon=True)
    prober.start()
    slows = [_open(host, port, KINDS[i % len(KINDS)]) for i in range(connections)]
    selector = selectors.DefaultSelector()
    for slow in slows:
        selector.register(slow.sock, selectors.EVENT_READ, slow)
    start = time.monotonic()
    while any(s.closed_at is None for s in slows) and time.monotonic() - start < max_s:
        for key, _ in selector.select(timeout=0.05):
            slow = key.data
            try:
                chunk = slow.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if chunk:
                slow.answer += chunk
                continue
            slow.closed_at = time.monotonic()
            selector.unregister(slow.sock)
            slow.sock.close()
        now = time.monotonic()
        for slow in slows:
            if slow.closed_at is None and slow.kind.startswith("trickled") and now >= slow.next_byte_at:
                slow.next_byte_at = now + TRICKLE_EVERY_S
                try:
                    slow.sock.send(b"X" if slow.kind == "trickled head" else b" ")
                    slow.sent += 1
                except OSError:
                    pass
    for slow in slows:
        if slow.closed_at is None:
            selector.unregister(slow.sock)
            slow.sock.close()
    probe.stop()
    prober.join(timeout=10)
    by_kind = {}
    for kind in KINDS:
        mine = [s for s in slows if s.kind == kind]
        held = [s.closed_at - s.deadline_from for s in mine if s.closed_at is not None]
        by_kind[kind] = {
            "connections": len(mine),
            "closed": len(held),
            "closed_within_timeout": sum(h <= limit[kind] + slack_s for h in held),
            "timeout_s": limit[kind],
            "longest_held_s": round(max(held, default=float("nan")), 2),
            "answered_408": sum(s.answer.startswith(b"HTTP/1.1 408") for s in mine),
        }
    return {
        "connections": connections,
        "all_closed_within_timeout": all(k["closed_within_timeout"] == k["connections"] for k in by_kind.values()),
        "kinds": by_kind,
        "operations": probe.summary(),
        "probe_failures": probe.failures,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.slowloris", description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running router (default: start sims + a router here)")
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--header-timeout-s", type=float, default=10.0, help="the router's listen.header_timeout_s")
    ap.add_argument("--body-timeout-s", type=float, default=60.0, help="the router's listen.body_timeout_s")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.url:
        summary = run(args.url, args.connections, args.header_timeout_s, args.body_timeout_s)
    else:
        from bench.stack import tiny_stack

        # the timeouts under test join the router's listen section
        listen = {"header_timeout_s": args.header_timeout_s, "body_timeout_s": args.body_timeout_s}
        with tiny_stack("bench-slowloris-", listen=listen) as router:
            summary = run(router.url, args.connections, args.header_timeout_s, args.body_timeout_s)
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    main()
