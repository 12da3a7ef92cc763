"""Tenants: does a noisy tenant over its token quota change another tenant's latency?

One sim VE and PD (zero latency profile) behind a router whose tenants file has `calm` and
`free` (no limits) and `noisy` (`tokens_per_min`, small). The calm tenant runs a closed loop at
a fixed concurrency, in interleaved rounds: alone; beside the same heavy load (a closed loop at
a higher concurrency) sent with `free`'s key (no quota); beside it sent with `noisy`'s key,
which honours each 429's Retry-After (as the openai client does); and beside it with `noisy`'s
key ignoring Retry-After (a flood of requests the router refuses: the router's worst case).
Reported: the calm tenant's p50/p99 in each case, side by side, and what the heavy loop got.
All traffic on 127.0.0.1, every loop bounded in count and time.

    .venv/bin/python -m bench.tenants [--rounds 3 --seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.common import RunRecord, percentile
from bench.httpload import Connection, Target, closed_loop, encode_post
from bench.procs import Proc
from bench.stack import engine_proc, router_proc

CALM, NOISY, FREE = "sk-bench-calm-0000", "sk-bench-noisy-0000", "sk-bench-free-0000"
RETRY_AFTER = re.compile(rb"retry after (\d+)s")
# case -> (the heavy loop's key, whether it honours Retry-After); None: the calm tenant alone
CASES: dict[str, tuple[str, bool] | None] = {
    "calm alone": None,
    "beside heavy load, no quota": (FREE, True),
    "beside noisy over quota, honouring Retry-After": (NOISY, True),
    "beside noisy over quota, ignoring Retry-After": (NOISY, False),
}
BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 16}
).encode()


def tenants_file(path: Path, tokens_per_min: int) -> None:
    path.write_text(
        f"tenant calm\ntenant free\ntenant noisy tokens_per_min={tokens_per_min}\n"
        f"key calm {CALM}\nkey free {FREE}\nkey noisy {NOISY}\n"
    )
    path.chmod(0o640)


async def _round(
    port: int, seconds: float, calm_c: int, heavy: tuple[str, bool] | None, heavy_c: int
) -> tuple[list[float], int, Counter]:
    """One round: the calm loop, and the heavy one beside it (`heavy`: its key, and whether it
    waits out each 429's Retry-After)."""
    target = {"router": Target("127.0.0.1", port)}
    statuses: Counter = Counter()
    stop_at = time.monotonic() + seconds

    def scenario(key: str, count: bool, honour: bool):
        raw = encode_post("/v1/chat/completions", BODY, port, {"Authorization": f"Bearer {key}"})

        async def one(conns: dict[str, Connection], _: int) -> tuple[bool, float]:
            response = await conns["router"].request(raw)
            if count:
                statuses[response.status] += 1
            if honour and response.status == 429 and (wait := RETRY_AFTER.search(response.body)):
                await asyncio.sleep(min(int(wait.group(1)), max(0.0, stop_at - time.monotonic())))
            return response.status == 200, response.first_byte_s

        return one

    loops = [
        closed_loop(target, scenario(CALM, False, False), concurrency=calm_c, max_requests=20_000, deadline_s=seconds)
    ]
    if heavy is not None:
        key, honour = heavy
        loops.append(
            closed_loop(
                target, scenario(key, True, honour), concurrency=heavy_c, max_requests=50_000, deadline_s=seconds
            )
        )
    results = await asyncio.gather(*loops)
    calm = results[0]
    return [x * 1e3 for x in calm.ok_latencies], sum(not s.ok for s in calm.samples), statuses


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each case")
    ap.add_argument("--seconds", type=float, default=4.0, help="per round")
    ap.add_argument("--calm-concurrency", type=int, default=2)
    ap.add_argument("--noisy-concurrency", type=int, default=8)
    ap.add_argument("--noisy-tokens-per-min", type=int, default=3000)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    rec = RunRecord.start("tenants")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "checkpoint")
    tenants = work / "tenants"
    tenants_file(tenants, args.noisy_tokens_per_min)
    procs: list[Proc] = [engine_proc("ve", 0, ckpt, work).start(), engine_proc("pd", 0, ckpt, work).start()]
    try:
        for p in procs:
            p.wait_healthy()
        router = router_proc(ckpt, procs[:1], procs[1:], work, extra={"auth": {"tenants_file": str(tenants)}})
        procs.append(router.start())
        router.wait_healthy()
        acc = {case: {"lat": [], "errors": 0, "noisy": Counter()} for case in CASES}
        asyncio.run(_round(router.port, 1.0, args.calm_concurrency, None, 0))  # warm-up
        for _ in range(args.rounds):
            for case, heavy in CASES.items():
                lat, errors, statuses = asyncio.run(
                    _round(router.port, args.seconds, args.calm_concurrency, heavy, args.noisy_concurrency)
                )
                acc[case]["lat"] += lat
                acc[case]["errors"] += errors
                acc[case]["noisy"].update(statuses)
        for case, a in acc.items():
            rec.results[case] = {
                "calm_requests": len(a["lat"]),
                "calm_errors": a["errors"],
                "calm_p50_ms": round(percentile(a["lat"], 50), 2),
                "calm_p99_ms": round(percentile(a["lat"], 99), 2),
                "heavy_statuses": {str(k): v for k, v in sorted(a["noisy"].items())},
            }
    finally:
        for p in reversed(procs):
            p.stop()
    rec.notes.append(
        f"calm concurrency {args.calm_concurrency}, heavy concurrency {args.noisy_concurrency}, "
        f"noisy tokens_per_min {args.noisy_tokens_per_min}, {args.rounds} interleaved rounds of {args.seconds:g} s"
    )
    rec.wall_s = time.perf_counter() - t0
    path = rec.save(args.out_dir)
    print(json.dumps(rec.results, indent=1))
    print(f"saved {path}")
    return rec


if __name__ == "__main__":
    main()
