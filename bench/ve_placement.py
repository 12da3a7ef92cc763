"""Section 3: VE placement quality, a discrete-event simulation over the router's real code.

What is real: the placement decisions. "ours" calls `epd_kit.router.placement.place_items`
with the same inputs the router gives it (content hash + encode work per unique item, and the
in-flight work per VE that the router tracks), and "reference HRW" calls `epd_kit.hrw.pick`
(docs/contract.md §4.1). What is simulated: the clock, the arrivals (Poisson), the image catalogue
(Zipf popularity), and each VE as one FIFO server (`--max-num-seqs 1`) with an LRU encoder
cache of a fixed number of items whose service time is `encode_s_per_token x tokens` for a
miss and `hit_s` for a hit, plus `post_s` per POST.

Because each VE is a FIFO server and only its own queue touches its cache, the hit/miss of an
item is known when it is enqueued (service order = enqueue order per VE), so the simulation
needs no event heap: it walks the requests in arrival order and retires finished POSTs from
per-VE queues to compute the router-visible in-flight work.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.common import IMG_DIR, RunRecord, percentile
from epd_kit import hrw
from epd_kit.router import placement
from epd_kit.router_yaml import Placement

SHIPPED = Placement()  # the router's default placement settings: "ours" is what ships

VE_IDS = [f"ve-{i}" for i in range(4)]


@dataclass(frozen=True)
class Workload:
    """Requests as (arrival time, unique items in prompt order); items are (hash, tokens)."""

    arrivals: list[float]
    requests: list[list[tuple[str, int]]]
    zipf_s: float
    catalogue: int


@dataclass(frozen=True)
class SimParams:
    n_requests: int = 20_000
    catalogue: int = 10_000  # distinct images
    cache_items: int = 127  # per VE: encoder_cache_num_blocks 128 minus the scratch block
    n_ve: int = 4
    target_utilisation: float = 0.7  # offered encode work / VE capacity, at the ceiling's miss rate
    encode_s_per_token: float = 0.0002  # 256-token (512x512) image = 51 ms
    hit_s: float = 0.001
    post_s: float = 0.002
    seed: int = 1


TOKEN_SIZES = (64, 176, 256)  # merged vision tokens: ~256x256, 512x352, 512x512 images


def make_workload(p: SimParams, zipf_s: float) -> Workload:
    """Arrival times are filled in later (they depend on the ceiling's miss rate)."""
    rng = np.random.default_rng(p.seed)
    ranks = np.arange(1, p.catalogue + 1, dtype=np.float64)
    probs = ranks**-zipf_s
    probs /= probs.sum()
    # a random permutation so popularity is not correlated with the hash or the size
    perm = rng.permutation(p.catalogue)
    tokens = rng.choice(TOKEN_SIZES, size=p.catalogue)
    keys = [f"{int(i):064x}" for i in rng.integers(0, 2**62, size=p.catalogue)]
    counts = rng.integers(1, 5, size=p.n_requests)  # 1..4 images per request
    draws = rng.choice(p.catalogue, size=int(counts.sum()), p=probs)
    requests: list[list[tuple[str, int]]] = []
    pos = 0
    for k in counts:
        seen: dict[str, int] = {}
        for rank in draws[pos : pos + k]:
            img = int(perm[rank])
            seen.setdefault(keys[img], int(tokens[img]))  # the router dedupes within a request
        pos += k
        requests.append(list(seen.items()))
    return Workload(arrivals=[], requests=requests, zipf_s=zipf_s, catalogue=p.catalogue)


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> bool:
        """True on a hit; inserts (and evicts the oldest) on a miss."""
        if key in self._d:
            self._d.move_to_end(key)
            return True
        self._d[key] = None
        if len(self._d) > self.capacity:
            self._d.popitem(last=False)
        return False


def ceiling_hit_rate(w: Workload, p: SimParams) -> float:
    """One shared LRU with the pool's total capacity, items in arrival order."""
    lru = LRU(p.cache_items * p.n_ve)
    hits = total = 0
    for req in w.requests:
        for key, _ in req:
            hits += lru.touch(key)
            total += 1
    return hits / total


def with_arrivals(w: Workload, p: SimParams, ceiling: float) -> Workload:
    """Poisson arrivals at the rate that loads the pool to `target_utilisation` at the ceiling."""
    rng = np.random.default_rng(p.seed + 1)
    mean_tokens = np.mean([t for req in w.requests for _, t in req])
    items_per_req = np.mean([len(r) for r in w.requests])
    work_per_item = (1 - ceiling) * mean_tokens * p.encode_s_per_token + ceiling * p.hit_s
    work_per_req = items_per_req * work_per_item + p.post_s * min(items_per_req, p.n_ve)
    rate = p.target_utilisation * p.n_ve / work_per_req
    gaps = rng.exponential(1 / rate, size=len(w.requests))
    return Workload(list(np.cumsum(gaps)), w.requests, w.zipf_s, w.catalogue)


# A policy maps (this request's unique items, in-flight work per VE) to mm_hash -> VE id.
Policy = Callable[[Sequence[tuple[str, int]], Mapping[str, float]], dict[str, str]]


def policy_ours(bound: float, slack_items: float) -> Policy:
    def place(items: Sequence[tuple[str, int]], loads: Mapping[str, float]) -> dict[str, str]:
        return placement.place_items([placement.Item(h, t) for h, t in items], loads, bound, slack_items=slack_items)

    return place


def policy_reference_hrw(items: Sequence[tuple[str, int]], loads: Mapping[str, float]) -> dict[str, str]:
    return {h: hrw.pick(h, list(loads)) for h, _ in items}


def policy_round_robin_per_item() -> Policy:
    cursor = 0

    def place(items: Sequence[tuple[str, int]], loads: Mapping[str, float]) -> dict[str, str]:
        nonlocal cursor
        ids = list(loads)
        out = {}
        for h, _ in items:
            out[h] = ids[cursor % len(ids)]
            cursor += 1
        return out

    return place


def policy_round_robin_restart(items: Sequence[tuple[str, int]], loads: Mapping[str, float]) -> dict[str, str]:
    """vLLM's example EPD proxy: item i of every request goes to encoder i (vllm#52484)."""
    ids = list(loads)
    return {h: ids[i % len(ids)] for i, (h, _) in enumerate(items)}


def policy_random(seed: int) -> Policy:
    rng = random.Random(seed)

    def place(items: Sequence[tuple[str, int]], loads: Mapping[str, float]) -> dict[str, str]:
        ids = list(loads)
        return {h: rng.choice(ids) for h, _ in items}

    return place


def policies(p: SimParams, bound: float, slack: float, what_if: Sequence[float] = ()) -> dict[str, Policy]:
    """Fresh policy objects (some keep a cursor) in the order the docs list them."""
    out = {
        "reference HRW": policy_reference_hrw,
        f"ours (HRW + load bound {bound:g} + {slack:g} items slack)": policy_ours(bound, slack),
        "round-robin per item": policy_round_robin_per_item(),
        "round-robin from encoder 0 (vllm#52484)": policy_round_robin_restart,
        "random": policy_random(p.seed),
    }
    for k in what_if:
        out[f"what-if: bound {bound:g} + {k:g} items slack (router code, not the default)"] = policy_ours(bound, k)
    return out


@dataclass
class PolicyResult:
    hit_rate: float
    hit_rate_vs_ceiling: float
    items_per_ve: list[int]
    busy_s_per_ve: list[float]
    max_mean_items: float
    max_mean_busy: float
    encode_wait_p50_ms: float
    encode_wait_p99_ms: float
    encode_wait_mean_ms: float
    spill_fraction: float  # items not on their first HRW choice
    extra: dict[str, float] = field(default_factory=dict)


def simulate(w: Workload, p: SimParams, place: Policy, ceiling: float) -> PolicyResult:
    ids = VE_IDS[: p.n_ve]
    caches = {v: LRU(p.cache_items) for v in ids}
    queues: dict[str, deque[tuple[float, int]]] = {v: deque() for v in ids}  # (done_at, work)
    inflight = dict.fromkeys(ids, 0.0)
    free_at = dict.fromkeys(ids, 0.0)
    items_n = dict.fromkeys(ids, 0)
    busy = dict.fromkeys(ids, 0.0)
    hits = total = spilled = 0
    waits: list[float] = []
    for t, req in zip(w.arrivals, w.requests, strict=True):
        for v in ids:  # retire POSTs that finished before this arrival
            q = queues[v]
            while q and q[0][0] <= t:
                inflight[v] -= q.popleft()[1]
        chosen = place(req, dict(inflight))
        groups: dict[str, list[tuple[str, int]]] = {}
        for h, tok in req:
            groups.setdefault(chosen[h], []).append((h, tok))
            spilled += chosen[h] != hrw.pick(h, ids)
        done = t
        for v, group in groups.items():
            service = p.post_s
            work = 0
            for h, tok in group:
                hit = caches[v].touch(h)
                hits += hit
                total += 1
                service += p.hit_s if hit else tok * p.encode_s_per_token
                work += tok
            start = max(t, free_at[v])
            free_at[v] = start + service
            busy[v] += service
            items_n[v] += len(group)
            queues[v].append((free_at[v], work))
            inflight[v] += work
            done = max(done, free_at[v])
        waits.append(done - t)
    items = [items_n[v] for v in ids]
    busy_l = [busy[v] for v in ids]
    hit_rate = hits / total
    return PolicyResult(
        hit_rate=hit_rate,
        hit_rate_vs_ceiling=hit_rate / ceiling,
        items_per_ve=items,
        busy_s_per_ve=busy_l,
        max_mean_items=max(items) / (sum(items) / len(items)),
        max_mean_busy=max(busy_l) / (sum(busy_l) / len(busy_l)),
        encode_wait_p50_ms=percentile(waits, 50) * 1e3,
        encode_wait_p99_ms=percentile(waits, 99) * 1e3,
        encode_wait_mean_ms=float(np.mean(waits)) * 1e3,
        spill_fraction=spilled / total,
    )


def run(p: SimParams, zipf_values: Sequence[float], bound: float, slack: float, what_if: Sequence[float] = ()) -> dict:
    out: dict = {
        "params": p.__dict__ | {"bound": bound, "slack_items": slack, "what_if_slack_items": list(what_if)},
        "by_zipf": {},
    }
    for s in zipf_values:
        w = make_workload(p, s)
        ceiling = ceiling_hit_rate(w, p)
        w = with_arrivals(w, p, ceiling)
        per_policy = {}
        for name, pol in policies(p, bound, slack, what_if).items():
            t0 = time.perf_counter()
            per_policy[name] = simulate(w, p, pol, ceiling)
            per_policy[name].extra["sim_wall_s"] = time.perf_counter() - t0
        out["by_zipf"][str(s)] = {
            "ceiling_hit_rate": ceiling,
            "offered_rate_per_s": len(w.arrivals) / w.arrivals[-1],
            "items": sum(len(r) for r in w.requests),
            "policies": per_policy,
        }
    return out


SWEEP_UTILISATION = (0.3, 0.5, 0.7, 0.85)


def sweep(p: SimParams, zipf_values: Sequence[float], bound: float, slack: float, what_if: Sequence[float]) -> dict:
    """Hit rate (% of ceiling) and balance vs offered load: the bound reacts to in-flight work,
    so its behaviour depends on how busy the pool is."""
    out: dict = {}
    for s in zipf_values:
        w0 = make_workload(p, s)
        ceiling = ceiling_hit_rate(w0, p)
        rows: dict = {}
        for u in SWEEP_UTILISATION:
            pu = SimParams(**{**p.__dict__, "target_utilisation": u})
            w = with_arrivals(w0, pu, ceiling)
            pols = policies(pu, bound, slack, what_if)
            for name in list(pols):
                if name.startswith(("round-robin", "random")):
                    del pols[name]
            for name, pol in pols.items():
                r = simulate(w, pu, pol, ceiling)
                rows.setdefault(name, []).append(
                    {
                        "utilisation": u,
                        "hit_rate_vs_ceiling": r.hit_rate_vs_ceiling,
                        "max_mean_items": r.max_mean_items,
                        "max_mean_busy": r.max_mean_busy,
                        "encode_wait_p99_ms": r.encode_wait_p99_ms,
                    }
                )
        out[str(s)] = rows
    return out


def plot_sweep(sw: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(sw), figsize=(6 * len(sw), 3.8), squeeze=False)
    for j, (z, rows) in enumerate(sw.items()):
        a_hit, a_bal = axes[0][2 * j], axes[0][2 * j + 1]
        for name, pts in rows.items():
            us = [pt["utilisation"] for pt in pts]
            style = "--" if name.startswith("what-if") else "-"
            a_hit.plot(us, [100 * pt["hit_rate_vs_ceiling"] for pt in pts], style, marker="o", label=name)
            a_bal.plot(us, [pt["max_mean_items"] for pt in pts], style, marker="o", label=name)
        a_hit.axhline(95, color="grey", linestyle=":")
        a_bal.axhline(1.25, color="grey", linestyle=":")
        a_hit.set_title(f"Zipf s={z}: hit rate, % of ceiling", fontsize=9)
        a_bal.set_title(f"Zipf s={z}: max/mean items per VE", fontsize=9)
        for ax in (a_hit, a_bal):
            ax.set_xlabel("offered load (fraction of VE capacity)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zipfs = list(results["by_zipf"])
    names = [n for n in next(iter(results["by_zipf"].values()))["policies"] if not n.startswith("what-if")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    width = 0.8 / len(names)
    x = np.arange(len(zipfs))
    for i, name in enumerate(names):
        rows = [results["by_zipf"][z]["policies"][name] for z in zipfs]
        off = x + (i - (len(names) - 1) / 2) * width
        axes[0].bar(off, [r.hit_rate for r in rows], width, label=name)
        axes[1].bar(off, [r.max_mean_items for r in rows], width)
        axes[2].bar(off, [r.encode_wait_p99_ms for r in rows], width)
    for j, z in enumerate(zipfs):
        c = results["by_zipf"][z]["ceiling_hit_rate"]
        axes[0].hlines(c, j - 0.45, j + 0.45, colors="k", linestyles="--")
        axes[0].hlines(0.95 * c, j - 0.45, j + 0.45, colors="grey", linestyles=":")
    axes[1].axhline(1.25, color="grey", linestyle=":")
    axes[0].set_title("encoder-cache hit rate (-- ceiling, : 95% of it)")
    axes[1].set_title("max/mean items per VE (: 1.25)")
    axes[2].set_title("p99 encode wait (ms, log)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xticks(x, [f"Zipf s={z}" for z in zipfs])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> RunRecord:
    ap = argparse.ArgumentParser(prog="python -m bench.ve_placement", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=SimParams.n_requests)
    ap.add_argument("--catalogue", type=int, default=SimParams.catalogue)
    ap.add_argument("--cache-items", type=int, default=SimParams.cache_items)
    ap.add_argument("--utilisation", type=float, default=SimParams.target_utilisation)
    ap.add_argument("--bound", type=float, default=SHIPPED.ve_load_bound, help="ours: placement.ve_load_bound")
    ap.add_argument(
        "--slack", type=float, default=SHIPPED.ve_load_slack_items, help="ours: placement.ve_load_slack_items"
    )
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.2])
    ap.add_argument(
        "--what-if-slack",
        type=float,
        nargs="*",
        default=[],
        help="also run bench-only variants of the bound with this many items of slack",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--sweep", action="store_true", help=f"also sweep offered load {SWEEP_UTILISATION} (reference, ours, what-ifs)"
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    rec = RunRecord.start("ve_placement")
    t0 = time.perf_counter()
    p = SimParams(
        n_requests=args.requests,
        catalogue=args.catalogue,
        cache_items=args.cache_items,
        target_utilisation=args.utilisation,
        seed=args.seed,
    )
    rec.results = run(p, args.zipf, args.bound, args.slack, args.what_if_slack)
    if args.sweep:
        rec.results["sweep"] = sweep(p, args.zipf, args.bound, args.slack, args.what_if_slack)
    rec.notes.append(
        "Discrete-event simulation: placement decisions are the router's real code "
        "(epd_kit.router.placement.place_items, epd_kit.hrw.pick); clock, arrivals, catalogue, "
        "VE service and LRU caches are simulated. Single run, fixed seed."
    )
    rec.wall_s = time.perf_counter() - t0
    from pathlib import Path

    out_dir = Path(args.out_dir) if args.out_dir else None
    path = rec.save(out_dir)
    if not args.no_plot:
        IMG_DIR.mkdir(parents=True, exist_ok=True)
        plot(rec.results, (out_dir or IMG_DIR) / "bench-ve-placement.png")
        if args.sweep:
            plot_sweep(rec.results["sweep"], (out_dir or IMG_DIR) / "bench-ve-placement-load.png")
    print_table(rec.results)
    print(f"wrote {path} in {rec.wall_s:.1f} s")
    return rec


def print_table(results: dict) -> None:
    for z, r in results["by_zipf"].items():
        print(
            f"\nZipf s={z}: ceiling hit rate {r['ceiling_hit_rate']:.3f}, "
            f"{r['offered_rate_per_s']:.1f} req/s offered, {r['items']} items"
        )
        print(
            f"  {'policy':50s} {'hit':>6s} {'%ceil':>6s} {'max/mean':>8s} {'busy m/m':>8s} "
            f"{'p50 ms':>8s} {'p99 ms':>9s} {'spill':>6s}"
        )
        for name, pr in r["policies"].items():
            print(
                f"  {name:50s} {pr.hit_rate:6.3f} {100 * pr.hit_rate_vs_ceiling:5.1f}% "
                f"{pr.max_mean_items:8.3f} {pr.max_mean_busy:8.3f} {pr.encode_wait_p50_ms:8.1f} "
                f"{pr.encode_wait_p99_ms:9.1f} {pr.spill_fraction:6.3f}"
            )


if __name__ == "__main__":
    main()
