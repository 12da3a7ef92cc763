"""Instructions per text chat request of epd-router (valgrind's callgrind), for comparing two
revisions on a shared machine: CPU time per request moves by up to 2x with the load of other
processes (docs/benchmarks.md "Peers at INFO"), an instruction count barely moves.

The peers setup (bench/peers.py: C stub engines, the tiny checkpoint, wrk, the router at
`--log-level`), with the router under callgrind with instrumentation off; it is switched on
after a warm-up, for an idle period and then one bounded wrk run of the same length, each
dumped. Instructions per request = the run's total, less the idle period's (health probes,
timers) scaled to the run's length, over the requests wrk completed. Under valgrind the
router runs ~50x slower, so few requests complete: compare revisions run back to back, not
with other sections' figures. Talks to 127.0.0.1 only.

    python -m bench.instructions [--baseline REV] [--seconds 20] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import peers
from bench.common import REPO, RunRecord
from bench.stack import router_proc


def measure(tree: Path, ckpt: Path, stubs: list, work: Path, body: Path, args: argparse.Namespace) -> dict:
    """Instructions per request of the router whose `router/` tree is `tree`."""
    wrk = peers.ensure_wrk()
    launcher = [sys.executable, "-c", "from epd_kit.router.cli import main; main()"]
    proc = router_proc(ckpt, stubs[:1], stubs[1:], work, launcher=launcher)
    proc.extra_env = {"PYTHONPATH": str(tree)}
    proc.argv[proc.argv.index("--log-level") + 1] = args.log_level
    out = work / "callgrind.out"
    proc.argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *proc.argv]
    proc.start(peers.PROXY_CPU)
    try:
        peers.wait_serving(proc, 300.0)
        peers.run_wrk(wrk, proc.url, body, args.concurrency, 5)  # warm-up, not counted
        control = ["callgrind_control"]
        subprocess.run([*control, "-i", "on", str(proc.pid)], check=True, capture_output=True, timeout=60)
        time.sleep(args.seconds)  # idle: the health probes and timers alone, subtracted below
        subprocess.run([*control, "-d", str(proc.pid)], check=True, capture_output=True, timeout=60)
        idle = _dumped(work)
        t0 = time.monotonic()
        run = peers.run_wrk(wrk, proc.url, body, args.concurrency, args.seconds)
        subprocess.run([*control, "-d", str(proc.pid)], check=True, capture_output=True, timeout=60)
        loaded_s = time.monotonic() - t0
        loaded = _dumped(work) - idle
    finally:
        proc.stop(30.0)
    background = idle * loaded_s / args.seconds
    per_request = (loaded - background) / max(run.requests, 1)
    return {
        "requests": run.requests,
        "errors": run.errors,
        "instructions_per_request": per_request,
        "background_share": background / loaded if loaded else 0.0,
    }


def _dumped(work: Path) -> int:
    """Instructions in every dump so far (callgrind.out at exit, the shutdown, is not one)."""
    lines = (line for p in work.glob("callgrind.out.*") for line in p.open())
    return sum(int(line.split()[1]) for line in lines if line.startswith("totals:"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="REV", help="also measure epd-router as of git revision REV")
    ap.add_argument("--seconds", type=float, default=20.0, help="the counted wrk run")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("needs valgrind (apt-get install valgrind)")
    rec = RunRecord.start("instructions")
    exe = peers.build_stub()
    work = Path(tempfile.mkdtemp(prefix="epd-instructions-"))
    body = work / "body.json"
    body.write_text(json.dumps(peers.BODY))
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "checkpoint")
    stubs = [peers.stub(name, exe, work) for name in ("stub-ve-0", "stub-pd-0", "stub-pd-1")]
    trees = {"epd-router": REPO / "router"}
    if args.baseline:
        base = peers.baseline_router(args.baseline, ckpt, stubs[:1], stubs[1:], work)  # extracts the tree
        trees = {f"epd-router @{args.baseline}": Path(base.extra_env["PYTHONPATH"]), **trees}
    try:
        for s in stubs:
            s.start(peers.LOAD_CPU).wait_healthy()
        for name, tree in trees.items():
            (work / name.replace(" ", "_")).mkdir()
            result = measure(tree, ckpt, stubs, work / name.replace(" ", "_"), body, args)
            rec.results[name] = result
            print(
                f"{name}: {result['instructions_per_request'] / 1e6:.2f} M instructions per request "
                f"({result['requests']} requests, {result['errors']} errors, c={args.concurrency}, "
                f"idle background {result['background_share']:.0%} subtracted)"
            )
    finally:
        for s in stubs:
            s.stop()
    print(f"saved {rec.save()}", file=sys.stderr)


if __name__ == "__main__":
    main()
