"""Section 4 (simulated variant): PD placement quality as a discrete-event simulation.

What is real: the placement decision. "least-outstanding" calls the router's
`epd_kit.router.placement.RoundRobin.choose_pd` with the router-visible in-flight count per PD
and the `placement.pd_max_inflight` cap; "round-robin" is the reference router's cursor
(docs/contract.md §4.2). What is simulated: Poisson arrivals, output lengths, and each PD as a
continuous-batching engine stepping like epd-sim: each step admits waiting requests up to
`max-num-seqs` (their prefill produces their first token) and advances every running one by a
token; a step costs `epd_kit.sim.profile.LatencyProfile.step_s(prefill tokens, decoding)`,
the sim's own latency model, so `bench.pd_placement` can drive real sim PDs with the same
numbers over HTTP.
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bench.common import RunRecord, percentile
from epd_kit.router import placement
from epd_kit.sim.profile import LatencyProfile, build_profile


@dataclass(frozen=True)
class PdParams:
    n_pd: int = 4
    max_num_seqs: int = 8
    prompt_tokens: int = 40
    prefill_ms_per_1k_tokens: float = 250.0
    decode_ms_per_token: float = 10.0
    decode_ms_per_extra_seq: float = 0.0
    min_tokens: int = 16
    max_tokens: int = 1024
    utilisation: float = 0.9  # offered requests/s / capacity_rps()
    n_requests: int = 20_000
    cap: int = 64  # placement.pd_max_inflight
    seed: int = 1

    def profile(self) -> LatencyProfile:
        """The sim's own latency model (epd_kit.sim.profile), with these step costs."""
        return build_profile(
            "zero",
            prefill_ms_per_1k_tokens=self.prefill_ms_per_1k_tokens,
            decode_ms_per_token=self.decode_ms_per_token,
            decode_ms_per_extra_seq=self.decode_ms_per_extra_seq,
        )


def output_lengths(p: PdParams, n: int, rng: np.random.Generator) -> np.ndarray:
    """Log-uniform between min and max tokens: many short answers, a long tail of long ones."""
    lo, hi = math.log(p.min_tokens), math.log(p.max_tokens)
    return np.exp(rng.uniform(lo, hi, size=n)).round().astype(int)


def mean_len(p: PdParams) -> float:
    lo, hi = math.log(p.min_tokens), math.log(p.max_tokens)
    return (p.max_tokens - p.min_tokens) / (hi - lo)


def capacity_rps(p: PdParams) -> float:
    """Requests/s the pool sustains with full batches: per request, its share of full decode
    steps (mean_len / max_num_seqs of them) plus its prefill, which stalls one step."""
    prof = p.profile()
    per_request_s = mean_len(p) * prof.step_s(0, p.max_num_seqs) / p.max_num_seqs + prof.step_s(p.prompt_tokens, 0)
    return p.n_pd / per_request_s


def offered_rate(p: PdParams) -> float:
    return p.utilisation * capacity_rps(p)


# chooser(candidates, inflight) -> PD id or None (all at the cap)
Chooser = Callable[[Sequence[str], dict[str, int]], str | None]


def reference_round_robin(cap: int) -> Chooser:
    """The reference router's PdRegistry.next(): a global cursor, no load information."""
    cursor = 0

    def choose(cands: Sequence[str], inflight: dict[str, int]) -> str | None:
        nonlocal cursor
        pick = cands[cursor % len(cands)]
        cursor += 1
        return pick

    return choose


def ours_least_outstanding(cap: int) -> Chooser:
    rr = placement.RoundRobin()

    def choose(cands: Sequence[str], inflight: dict[str, int]) -> str | None:
        return rr.choose_pd(cands, inflight, cap)

    return choose


@dataclass
class PdResult:
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    tokens_per_s: float
    max_mean_requests: float


class _Engine:
    """One PD: continuous batching in steps, as epd-sim schedules (waiting FIFO, max_num_seqs)."""

    def __init__(self, p: PdParams) -> None:
        self.p = p
        self.profile = p.profile()
        self.waiting: deque[int] = deque()
        self.running: dict[int, int] = {}  # request -> tokens still to emit
        self.busy = False
        self.admitted: list[int] = []

    def start_step(self) -> float:
        """Admit what fits and return the step's duration (0 if there is nothing to do)."""
        self.admitted = []
        while self.waiting and len(self.running) + len(self.admitted) < self.p.max_num_seqs:
            self.admitted.append(self.waiting.popleft())
        if not self.admitted and not self.running:
            self.busy = False
            return 0.0
        self.busy = True
        return self.profile.step_s(self.p.prompt_tokens * len(self.admitted), len(self.running))


def simulate(p: PdParams, choose: Chooser) -> PdResult:
    rng = np.random.default_rng(p.seed)
    rate = offered_rate(p)
    arrivals = np.cumsum(rng.exponential(1 / rate, size=p.n_requests))
    lengths = output_lengths(p, p.n_requests, rng)
    ids = [f"pd-{i}" for i in range(p.n_pd)]
    engines = {i: _Engine(p) for i in ids}
    inflight = dict.fromkeys(ids, 0)
    assigned = dict.fromkeys(ids, 0)
    router_queue: deque[int] = deque()
    ttft = np.zeros(p.n_requests)
    done_at = np.zeros(p.n_requests)
    events: list[tuple[float, int, str, str | int]] = [(float(t), r, "arrive", r) for r, t in enumerate(arrivals)]
    heapq.heapify(events)
    seq = p.n_requests

    def kick(pd: str, now: float) -> None:
        nonlocal seq
        dur = engines[pd].start_step()
        if engines[pd].busy:
            heapq.heappush(events, (now + dur, seq, "step", pd))
            seq += 1

    def dispatch(r: int, now: float) -> bool:
        pd = choose(ids, inflight)
        if pd is None:
            return False
        inflight[pd] += 1
        assigned[pd] += 1
        engines[pd].waiting.append(r)
        if not engines[pd].busy:
            kick(pd, now)
        return True

    while events:
        now, _, kind, who = heapq.heappop(events)
        if kind == "arrive":
            if router_queue or not dispatch(int(who), now):
                router_queue.append(int(who))
            continue
        pd = str(who)
        eng = engines[pd]
        finished = []
        for r in list(eng.running):
            eng.running[r] -= 1
            if eng.running[r] == 0:
                finished.append(r)
        for r in eng.admitted:
            ttft[r] = now - arrivals[r]
            eng.running[r] = int(lengths[r]) - 1
            if eng.running[r] == 0:
                finished.append(r)
        for r in finished:
            del eng.running[r]
            done_at[r] = now
            inflight[pd] -= 1
        kick(pd, now)
        while router_queue and dispatch(router_queue[0], now):
            router_queue.popleft()
    e2e = done_at - arrivals
    span = float(done_at.max() - arrivals[0])
    counts = list(assigned.values())
    return PdResult(
        ttft_p50_ms=percentile(list(ttft), 50) * 1e3,
        ttft_p99_ms=percentile(list(ttft), 99) * 1e3,
        ttft_mean_ms=float(ttft.mean()) * 1e3,
        e2e_p50_ms=percentile(list(e2e), 50) * 1e3,
        e2e_p99_ms=percentile(list(e2e), 99) * 1e3,
        throughput_rps=p.n_requests / span,
        tokens_per_s=float(lengths.sum()) / span,
        max_mean_requests=max(counts) / (sum(counts) / len(counts)),
    )


def run(p: PdParams) -> dict:
    out = {
        "params": p.__dict__,
        "offered_rate_per_s": offered_rate(p),
        "capacity_rps": capacity_rps(p),
        "policies": {
            "round-robin (reference)": simulate(p, reference_round_robin(p.cap)),
            "least-outstanding (ours)": simulate(p, ours_least_outstanding(p.cap)),
        },
    }
    rr, lo = out["policies"].values()
    out["p99_ttft_reduction"] = 1 - lo.ttft_p99_ms / rr.ttft_p99_ms
    return out


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.pd_placement_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=PdParams.n_requests)
    ap.add_argument("--utilisation", type=float, nargs="+", default=[0.9])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    rec = RunRecord.start("pd_placement_sim")
    t0 = time.perf_counter()
    rec.results = {
        str(u): run(PdParams(n_requests=args.requests, utilisation=u, seed=args.seed)) for u in args.utilisation
    }
    rec.notes.append(
        "Discrete-event simulation: the PD choice is the router's real code "
        "(placement.RoundRobin.choose_pd); arrivals, lengths and PD engines are simulated. "
        "Single run, fixed seed."
    )
    rec.wall_s = time.perf_counter() - t0
    from pathlib import Path

    path = rec.save(Path(args.out_dir) if args.out_dir else None)
    for u, res in rec.results.items():
        print(f"utilisation {u}: offered {res['offered_rate_per_s']:.1f} req/s")
        for name, r in res["policies"].items():
            print(
                f"  {name:28s} TTFT p50 {r.ttft_p50_ms:8.1f} ms p99 {r.ttft_p99_ms:8.1f} ms  "
                f"{r.throughput_rps:6.1f} req/s  max/mean {r.max_mean_requests:.3f}"
            )
        print(f"  p99 TTFT reduction: {100 * res['p99_ttft_reduction']:.1f}%")
    print(f"wrote {path} in {rec.wall_s:.1f} s")
    return rec


if __name__ == "__main__":
    main()
