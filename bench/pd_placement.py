"""Section 4 (real HTTP): PD placement quality against 4 real sim PDs over 127.0.0.1.

What is real: four `epd-sim` PD processes (the kit's argv from the planner, `--max-num-seqs
8`, the sim's continuous-batching engine loop with `--sim-*` step costs), streaming
`/inference/v1/generate` over HTTP, and the placement code: "least-outstanding (ours)" is
`epd_kit.router.placement.RoundRobin.choose_pd` with the router's default cap
(placement.pd_max_inflight); "round-robin (reference)" is the reference router's cursor.
The bench process plays the router's PD-placement role (epd-router has no switch to the
reference policy, and streaming tokens through it would measure its CPU, not the policy).
What is generated: Poisson arrivals at a fixed offered load (a fraction of the pool's
capacity), output lengths log-uniform in 16..1024 tokens (`ignore_eos`, so exact), a short
text prompt. Both policies see the same arrival times and lengths; the runs are back to
back on the same engines. TTFT = first token frame received - scheduled arrival time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import pd_placement_sim as model
from bench.common import IMG_DIR, RunRecord, percentile
from bench.httpload import Connection, LoadError, Target, encode_post
from bench.procs import Proc, pin_self
from bench.router_overhead import _wait_ready
from bench.stack import engine_proc, router_proc
from epd_kit import wire
from epd_kit.router_yaml import Placement

FIRST_TOKEN = b'"token_ids":['


@dataclass
class HttpResult:
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_rps: float
    tokens_per_s: float
    completed: int
    errors: int
    max_dispatch_lag_ms: float
    per_pd_requests: list[int]
    wrong_lengths: int
    error_examples: list[str]
    tpot_p50_ms: float  # observed decode time per token (sim nominal: --decode-ms)
    router_cpu_ms_per_1k_tokens: float | None = None  # end-to-end pass only


ROUTER = "epd-router"
ROUTER_FIRST_FRAME = b'"delta"'


def chat_body(r: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "bench",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {r}: write a long story about the sea."}],
        }
    ).encode()


async def drive(
    p: model.PdParams,
    chooser: model.Chooser | None,
    pds: list[Proc],
    arrivals: np.ndarray,
    lengths: np.ndarray,
    prompt: list[int],
    deadline_s: float,
    router: Proc | None = None,
) -> HttpResult:
    """Open-loop Poisson load. With `router`, requests go to epd-router's OpenAI API and the
    router places them itself (chooser unused); otherwise straight to the PDs."""
    ids = [pd.name for pd in pds] if router is None else [ROUTER]
    by_id = {pd.name: pd for pd in pds} if router is None else {ROUTER: router}
    inflight = dict.fromkeys(ids, 0)
    assigned = dict.fromkeys(ids, 0)
    idle: dict[str, list[Connection]] = {i: [] for i in ids}
    ttft: list[float] = []
    e2e: list[float] = []
    tpot: list[float] = []
    errors = wrong = 0
    examples: list[str] = []
    lag = 0.0
    waiters: list[asyncio.Future] = []  # requests waiting for a PD below the cap
    t0 = time.perf_counter() + 0.2
    stop_at = t0 + deadline_s

    async def one(r: int) -> None:
        nonlocal errors, wrong, lag
        due = t0 + float(arrivals[r])
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        lag = max(lag, time.perf_counter() - due)
        if time.perf_counter() > stop_at:
            return
        pd = chooser(ids, inflight) if chooser is not None else ROUTER
        while pd is None:  # all PDs at the cap: wait for a completion (router queue)
            fut = asyncio.get_running_loop().create_future()
            waiters.append(fut)
            await fut
            pd = chooser(ids, inflight)
        inflight[pd] += 1
        assigned[pd] += 1
        conn = idle[pd].pop() if idle[pd] else Connection(Target("127.0.0.1", by_id[pd].port))
        if router is None:
            path, marker = wire.GENERATE_PATH, FIRST_TOKEN
            body = json.dumps(
                wire.GenerateRequest(
                    request_id=f"bench-{r}",
                    token_ids=prompt,
                    sampling_params=wire.SamplingParams(max_tokens=int(lengths[r]), ignore_eos=True),
                    stream=True,
                    stream_options=wire.StreamOptions(include_usage=True),
                ).wire_dict()
            ).encode()
        else:
            path, marker, body = "/v1/chat/completions", ROUTER_FIRST_FRAME, chat_body(r, int(lengths[r]))
        try:
            sent = time.perf_counter()
            resp = await asyncio.wait_for(
                conn.request(encode_post(path, body, by_id[pd].port), first_event=marker),
                timeout=max(1.0, stop_at + 60 - sent),
            )
            done = time.perf_counter()
            if resp.status != 200:
                raise LoadError(f"HTTP {resp.status}: {resp.body[:200]!r}")
            ttft.append(sent + resp.first_byte_s - due)
            e2e.append(done - due)
            if lengths[r] > 1:
                tpot.append((done - sent - resp.first_byte_s) / (int(lengths[r]) - 1))
            usage = [json.loads(x)["usage"] for x in _payloads(resp.body) if b'"usage":{' in x]
            n_tokens = usage[-1]["completion_tokens"] if usage else -1
            wrong += n_tokens != int(lengths[r])
            idle[pd].append(conn)
        except (OSError, LoadError, asyncio.IncompleteReadError, TimeoutError) as exc:
            errors += 1
            if len(examples) < 5:
                examples.append(f"{type(exc).__name__}: {exc}")
            await conn.close()
        finally:
            inflight[pd] -= 1
            while waiters:
                w = waiters.pop(0)
                if not w.done():
                    w.set_result(None)
                    break

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in range(len(arrivals))))
    span = time.perf_counter() - start
    for conns in idle.values():
        for c in conns:
            await c.close()
    done_n = len(ttft)
    return HttpResult(
        ttft_p50_ms=percentile(ttft, 50) * 1e3,
        ttft_p99_ms=percentile(ttft, 99) * 1e3,
        ttft_mean_ms=float(np.mean(ttft)) * 1e3 if ttft else float("nan"),
        e2e_p50_ms=percentile(e2e, 50) * 1e3,
        e2e_p99_ms=percentile(e2e, 99) * 1e3,
        throughput_rps=done_n / span,
        tokens_per_s=float(lengths[:done_n].sum()) / span,
        completed=done_n,
        errors=errors,
        max_dispatch_lag_ms=lag * 1e3,
        per_pd_requests=[assigned[i] for i in ids],
        wrong_lengths=wrong,
        error_examples=examples,
        tpot_p50_ms=percentile(tpot, 50) * 1e3,
    )


def _print(name: str, r: HttpResult) -> None:
    print(
        f"HTTP {name:26s} TTFT p50 {r.ttft_p50_ms:8.1f} p99 {r.ttft_p99_ms:8.1f} ms "
        f"{r.throughput_rps:5.1f} req/s {r.tokens_per_s:6.0f} tok/s done {r.completed} "
        f"tpot {r.tpot_p50_ms:.1f} ms err {r.errors} {r.error_examples[:1]} wrong-len {r.wrong_lengths} "
        f"lag {r.max_dispatch_lag_ms:.0f} ms per-PD {r.per_pd_requests}"
        + (f" router CPU {r.router_cpu_ms_per_1k_tokens:.0f} ms/1k tokens" if r.router_cpu_ms_per_1k_tokens else ""),
        flush=True,
    )


def _payloads(body: bytes) -> list[bytes]:
    return [chunk[6:] for chunk in body.split(b"\n\n") if chunk.startswith(b"data: {")]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    n_pd = results.get("params", {}).get("n_pd", 4)
    groups = [
        (f"real HTTP, {n_pd} sim PDs", results.get("http", {})),
        ("discrete-event sim (same model)", results.get("des", {})),
    ]
    colors = ["tab:grey", "tab:blue", "tab:green"]
    for ax, (title, res) in zip(axes, groups, strict=True):
        if not res:
            ax.set_visible(False)
            continue
        for i, (name, r) in enumerate(res["policies"].items()):
            p50, p99 = _get(r, "ttft_p50_ms"), _get(r, "ttft_p99_ms")
            ax.bar([i * 3, i * 3 + 1], [p50, p99], color=colors[i % 3], label=name)
            ax.text(i * 3 + 1, p99, f"{p99:.0f}", ha="center", va="bottom", fontsize=8)
            ax.text(i * 3, p50, f"{p50:.0f}", ha="center", va="bottom", fontsize=8)
        n = len(res["policies"])
        ax.set_xticks([x for i in range(n) for x in (i * 3, i * 3 + 1)], ["p50", "p99"] * n)
        ax.set_ylabel("TTFT (ms)")
        red = res.get("p99_ttft_reduction")
        ax.set_title(
            f"{title}\nleast-outstanding: p99 TTFT {100 * red:.0f}% lower than round-robin"
            if red is not None
            else title,
            fontsize=9,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _get(r, key):
    return r[key] if isinstance(r, dict) else getattr(r, key)


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.pd_placement", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="per policy")
    ap.add_argument("--utilisation", type=float, default=0.9, help="offered load / capacity")
    ap.add_argument("--pds", type=int, default=4, help="number of sim PDs")
    ap.add_argument("--decode-ms", type=float, default=10.0, help="sim decode step (ms/token)")
    ap.add_argument("--prefill-ms-per-1k", type=float, default=250.0)
    ap.add_argument("--deadline-s", type=float, default=240.0, help="per policy")
    ap.add_argument("--des-requests", type=int, default=20_000, help="0 = skip the DES companion")
    ap.add_argument("--cpu", default=None, help="pin the bench and the engines (default: none)")
    ap.add_argument(
        "--through-router",
        action="store_true",
        help="third pass: the same load through epd-router (its own PD placement)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    pin_self(args.cpu)
    rec = RunRecord.start("pd_placement")
    t_start = time.perf_counter()
    cap = Placement().pd_max_inflight
    p = model.PdParams(
        n_pd=args.pds,
        n_requests=args.requests,
        utilisation=args.utilisation,
        seed=args.seed,
        decode_ms_per_token=args.decode_ms,
        decode_ms_per_extra_seq=0.0,
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        cap=cap,
    )
    rng = np.random.default_rng(p.seed)
    arrivals = np.cumsum(rng.exponential(1 / model.offered_rate(p), size=p.n_requests))
    lengths = model.output_lengths(p, p.n_requests, rng)
    work = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "checkpoint")
    flags = [
        "--sim-profile",
        "zero",
        "--sim-decode-ms-per-token",
        str(p.decode_ms_per_token),
        "--sim-prefill-ms-per-1k-tokens",
        str(p.prefill_ms_per_1k_tokens),
    ]
    pds = [engine_proc("pd", i, ckpt, work, max_num_seqs=p.max_num_seqs, sim_flags=flags) for i in range(p.n_pd)]
    prompt = [11 + (i % 200) for i in range(p.prompt_tokens)]
    procs: list[Proc] = list(pds)
    try:
        for pd in pds:
            pd.start(args.cpu)
        for pd in pds:
            pd.wait_healthy()
        http = {}
        for name, make in (
            ("round-robin (reference)", model.reference_round_robin),
            ("least-outstanding (ours)", model.ours_least_outstanding),
        ):
            http[name] = asyncio.run(drive(p, make(cap), pds, arrivals, lengths, prompt, args.deadline_s))
            _print(name, http[name])
        if args.through_router:
            ve = engine_proc("ve", 0, ckpt, work).start(args.cpu)
            procs.append(ve)
            ve.wait_healthy()
            router = router_proc(ckpt, [ve], pds, work).start(args.cpu)
            procs.append(router)
            router.wait_healthy()
            _wait_ready(router)
            name = "least-outstanding inside epd-router (end to end)"
            cpu0 = router.cpu_s()
            http[name] = asyncio.run(drive(p, None, pds, arrivals, lengths, prompt, args.deadline_s, router))
            tokens = float(lengths[: http[name].completed].sum())
            http[name].router_cpu_ms_per_1k_tokens = (router.cpu_s() - cpu0) * 1e3 / tokens * 1000
            _print(name, http[name])
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    rr, lo = list(http.values())[:2]
    rec.results = {
        "params": p.__dict__,
        "capacity_rps": model.capacity_rps(p),
        "offered_rate_per_s": model.offered_rate(p),
        "http": {
            "policies": http,
            "p99_ttft_reduction": 1 - lo.ttft_p99_ms / rr.ttft_p99_ms,
            "p50_ttft_reduction": 1 - lo.ttft_p50_ms / rr.ttft_p50_ms,
        },
    }
    if args.des_requests:
        des_p = model.PdParams(**{**p.__dict__, "n_requests": args.des_requests})
        rec.results["des"] = model.run(des_p)
        d = rec.results["des"]
        print(
            f"DES  p99 TTFT reduction {100 * d['p99_ttft_reduction']:.1f}% "
            f"({args.des_requests} requests, same model and load)"
        )
    rec.notes.append(
        "Real HTTP: 4 epd-sim PD processes, streaming; placement code in the bench process. "
        f"Single run, seed {args.seed}; both policies see the same arrivals and lengths."
    )
    rec.wall_s = time.perf_counter() - t_start
    path = rec.save(args.out_dir)
    if not args.no_plot:
        IMG_DIR.mkdir(parents=True, exist_ok=True)
        plot(rec.results, (args.out_dir or IMG_DIR) / "bench-pd-placement.png")
    print(
        f"HTTP p99 TTFT reduction {100 * rec.results['http']['p99_ttft_reduction']:.1f}%; "
        f"wrote {path} in {rec.wall_s:.1f} s"
    )
    return rec


if __name__ == "__main__":
    main()
