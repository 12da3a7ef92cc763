"""How many concurrent streams one epd-sim PD process serves before it becomes the bottleneck.

Starts one PD (`epd-sim serve` with the tutorial's PD argv, --max-num-seqs = streams) pinned
to one CPU core, opens N concurrent streaming requests from a lean asyncio client pinned to
another core, and compares the token rate delivered with the rate the latency profile asks
for. Everything stays on 127.0.0.1; the run is bounded in requests and time.

    .venv/bin/python bench/sim_capacity.py --streams 500 --tokens 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


async def one_stream(port: int, max_tokens: int, idx: int) -> tuple[int, float]:
    body = json.dumps(
        {
            "request_id": f"cap-{idx}",
            "token_ids": [11, 12, 13, idx % 100],
            "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(
        b"POST /inference/v1/generate HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    t0, tokens, buf = time.monotonic(), 0, b""
    first = None
    while True:
        data = await reader.read(65536)
        if not data:
            break
        buf += data
        *frames, buf = buf.split(b"\n\n")
        for frame in frames:
            i = frame.find(b'"token_ids":[')
            if i >= 0:
                j = frame.index(b"]", i)
                ids = frame[i + 13 : j]
                if ids:
                    tokens += ids.count(b",") + 1
                    first = first or time.monotonic() - t0
        if b"data: [DONE]" in buf or b"data: [DONE]" in data:
            break
    writer.close()
    return tokens, first or 0.0


async def drive(port: int, streams: int, max_tokens: int, limit_s: float) -> list[tuple[int, float]]:
    tasks = [one_stream(port, max_tokens, i) for i in range(streams)]
    async with asyncio.timeout(limit_s):
        return await asyncio.gather(*tasks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--decode-ms", type=float, default=30.0)
    ap.add_argument("--decode-ms-per-extra-seq", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--sim-core", type=int, default=0)
    ap.add_argument("--client-core", type=int, default=1)
    args = ap.parse_args()
    if not 1 <= args.streams <= 2000 or not 1 <= args.tokens <= 2000:
        ap.error("streams and tokens must be within 1..2000 (bounded load)")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
    from epd_kit.sim import launch
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="sim-capacity-"))
    model = build_tiny_checkpoint(work / "ckpt")
    port = launch.free_port()
    sim = Path(sys.executable).parent / "epd-sim"
    argv = launch.serve_argv(
        "pd", str(model), port, engine_id="cap", tp=8, max_num_seqs=args.streams, executable=str(sim)
    )
    argv.append("--disable-uvicorn-access-log")
    if shutil.which("taskset"):
        argv = ["taskset", "-c", str(args.sim_core)] + argv
    env = {
        **launch.engine_env(
            "0,1,2,3,4,5,6,7",
            profile="zero",
            decode_ms_per_token=str(args.decode_ms),
            decode_ms_per_extra_seq=str(args.decode_ms_per_extra_seq),
        ),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "router"),
    }
    proc = launch.SimProcess(argv, env, work / "sim.log")
    try:
        proc.wait_ready(30)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {args.client_core})
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        results = asyncio.run(drive(port, args.streams, args.tokens, args.timeout))
        wall, cpu = time.monotonic() - t0, cpu_seconds(proc.pid) - cpu0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
        client_cpu = me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime
    finally:
        proc.stop()
    tokens = sum(t for t, _ in results)
    ttfts = sorted(f for _, f in results)
    step_ms = args.decode_ms + args.decode_ms_per_extra_seq * (args.streams - 1)
    ideal_s = args.tokens * step_ms / 1000
    report = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "tokens_received": tokens,
        "complete": tokens == args.streams * args.tokens,
        "wall_s": round(wall, 2),
        "ideal_wall_s": round(ideal_s, 2),
        "efficiency": round(ideal_s / wall, 3),
        "tokens_per_s": round(tokens / wall),
        "sim_cpu_s": round(cpu, 2),
        "sim_cpu_share_of_one_core": round(cpu / wall, 3),
        "sim_cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 1),
        "client_cpu_share_of_one_core": round(client_cpu / wall, 3),
        "loadavg_1m": os.getloadavg()[0],
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
        "ttft_max_ms": round(1000 * ttfts[-1], 1),
    }
    print(json.dumps(report, indent=2))
    return 0 if report["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
