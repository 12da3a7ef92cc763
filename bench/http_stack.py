"""The figures behind the router's HTTP libraries (docs/dependencies.md): CPU per request of
each engine-path client and each uvicorn server protocol/loop pair, on this machine, against
the C stub engine (bench/stub_engine.c), everything on 127.0.0.1.

client  N POSTs of a small generate body to the stub, at concurrency 1 and 16, from one
        process pinned to CPU 1 (the stub on CPU 0); CPU = the process's own time.
server  uvicorn serving a trivial ASGI app (read the body, answer a small JSON) on CPU 1,
        wrk with bench/wrk/chat.lua on CPU 0 at c=16; CPU = the server's utime+stime.

    python -m bench.http_stack [--requests 3000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import LOAD_CPU, PROXY_CPU, build_stub, ensure_wrk, run_wrk, stub
from bench.procs import Proc, free_port

BODY = json.dumps({"request_id": "b", "token_ids": list(range(30)), "sampling_params": {"max_tokens": 16}}).encode()
HEADERS = {"content-type": "application/json"}
CLIENTS = ("httpx", "aiohttp")
LOOPS = ("asyncio", "uvloop")
PROTOCOLS = ("h11", "httptools")


async def _httpx(url: str, n: int, conc: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:

        async def worker(k: int) -> None:
            for _ in range(k):
                (await client.post(url, content=BODY, headers=HEADERS, timeout=10)).read()

        await worker(5)
        t = time.process_time()
        await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
        return time.process_time() - t


async def _aiohttp(url: str, n: int, conc: int) -> float:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(k: int) -> None:
            for _ in range(k):
                async with session.post(url, data=BODY, headers=HEADERS) as r:
                    await r.read()

        await worker(5)
        t = time.process_time()
        await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
        return time.process_time() - t


def client_cell(client: str, loop: str, url: str, n: int, conc: int) -> float:
    """CPU ms per request of one client/loop pair (run in this process, pinned)."""
    fn = _httpx if client == "httpx" else _aiohttp
    if loop == "uvloop":
        import uvloop

        cpu = uvloop.run(fn(url, n, conc))
    else:
        cpu = asyncio.run(fn(url, n, conc))
    return cpu * 1000 / (n // conc * conc)


APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})
"""


def server_cell(protocol: str, loop: str, work: Path, wrk: str, body: Path, seconds: float) -> float:
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "bench_app:app", "--port", str(port), "--http", protocol]
    argv += ["--loop", loop, "--log-level", "warning", "--no-access-log", "--app-dir", str(work)]
    proc = Proc(name=f"uvicorn-{protocol}-{loop}", argv=argv, port=port, health_path="/", log_path=work / "srv.log")
    proc.start(PROXY_CPU)
    try:
        proc.wait_healthy(20)  # the app answers 200 on every path
        run_wrk(wrk, proc.url, body, 16, 1)
        return run_wrk(wrk, proc.url, body, 16, seconds, proc.pid).cpu_ms_per_req or float("nan")
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--client-cell", nargs=4, metavar=("CLIENT", "LOOP", "URL", "CONC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_cell:  # one client measurement in a fresh process
        client, loop, url, conc = args.client_cell
        print(client_cell(client, loop, url, args.requests, int(conc)))
        return
    work = Path(tempfile.mkdtemp(prefix="epd-http-stack-"))
    (work / "bench_app.py").write_text(APP)
    body = work / "body.json"
    body.write_bytes(BODY)
    wrk = ensure_wrk()
    engine = stub("stub", build_stub(), work).start(LOAD_CPU)
    rows = []
    try:
        engine.wait_healthy()
        url = engine.url + "/inference/v1/generate"
        for client in CLIENTS:
            for loop in LOOPS:
                cells = []
                for conc in (1, 16):
                    out = subprocess.run(
                        ["taskset", "-c", PROXY_CPU, sys.executable, "-m", "bench.http_stack"]
                        + ["--requests", str(args.requests), "--client-cell", client, loop, url, str(conc)],
                        capture_output=True,
                        text=True,
                        check=True,
                        timeout=300,
                        env={**os.environ},
                    )
                    cells.append(float(out.stdout.strip().splitlines()[-1]))
                rows.append(f"| client {client} | {loop} | {cells[0]:.3f} ms (c=1) / {cells[1]:.3f} ms (c=16) |")
        for protocol in PROTOCOLS:
            for loop in LOOPS:
                cpu = server_cell(protocol, loop, work, wrk, body, args.seconds)
                rows.append(f"| server uvicorn --http {protocol} | {loop} | {cpu:.3f} ms (c=16) |")
    finally:
        engine.stop()
    print("| what | loop | CPU per request |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
