"""Smoke test of bench section 1: real sim engines, epd-router and the floor proxy on
127.0.0.1, a handful of requests of each kind through all three paths."""

from __future__ import annotations

from bench import router_overhead


def test_router_overhead_tiny(tmp_path):
    rec = router_overhead.main(
        [
            "--concurrency",
            "2",
            "--kinds",
            "text",
            "image-distinct",
            "--text-requests",
            # /proc counts CPU in 10 ms ticks: 8 text requests (~1 ms of router CPU each) read 0
            # once; 40 cross the resolution
            "40",
            "--image-requests",
            "3",
            "--cell-seconds",
            "5",
            "--rounds",
            "1",
            "--text-rounds",
            "1",
            "--reuse-proxies",
            "--loadgen-cpu",
            "",
            "--proxy-cpu",
            "",
            "--out-dir",
            str(tmp_path),
        ]
    )
    cells = rec.results["cells"]
    for kind in ("text", "image-distinct"):
        row = cells[kind]["2"]
        for cfg in ("direct", "floor", "router"):
            assert row[cfg]["errors"] == 0, (kind, cfg, row[cfg]["error_examples"])
            assert row[cfg]["n"] > 0 and row[cfg]["p50_ms"] > 0
        assert row["router"]["proxy_cpu_ms_per_1k"] > 0
        assert row["router"]["proxy_peak_rss_mib"] > 10
        assert row["direct"]["proxy_cpu_ms_per_1k"] is None
    assert (tmp_path / "bench-router-overhead.png").stat().st_size > 0
    assert (tmp_path / "router_overhead.json").exists()
    assert router_overhead.jpeg_variant(b"\xff\xd8rest", 3).startswith(b"\xff\xd8\xff\xfe\x00\x09bench-3")


def test_profile_summary_buckets():
    raw = "\n".join(
        [
            "main (r.py:1);run (uvicorn/server.py:2);select (selectors.py:468) 50",
            "main (r.py:1);_worker (concurrent/futures/thread.py:81);_prepare (epd_kit/preprocess/preprocessor.py:9);"
            "PixelEncoder.pixel_values (epd_kit/preprocess/image.py:187);_wrapfunc (numpy/_core/fromnumeric.py:54) 30",
            "main (r.py:1);send (httpcore/_async/connection.py:5);getpeername (asyncio/trsock.py:77) 20",
            "main (r.py:1);_worker (concurrent/futures/thread.py:81) 40",
        ]
    )
    s = router_overhead.summarize_stacks(raw)
    assert s["samples"] == 140 and s["busy_samples"] == 50
    assert s["share_of_busy"]["preprocess: pixel_values (numpy)"] == 0.6
    assert s["share_of_busy"]["httpx/httpcore client (engine calls)"] == 0.4


def test_router_overhead_before_and_traced_paths(tmp_path):
    """--baseline REF and --traced add two routers to the same rotation: each answers every
    request, and the traced one's spans reach the bench's receiver."""
    # enough requests for each router's CPU to show at /proc's 10 ms resolution
    args = ["--concurrency", "2", "--kinds", "text", "--text-requests", "150", "--cell-seconds", "5"]
    args += ["--text-rounds", "1", "--loadgen-cpu", "", "--proxy-cpu", "", "--no-plot", "--out-dir", str(tmp_path)]
    rec = router_overhead.main([*args, "--baseline", "HEAD", "--traced"])
    row = rec.results["cells"]["text"]["2"]
    for cfg in ("router", "before", "traced"):
        assert row[cfg]["errors"] == 0 and row[cfg]["n"] > 0, (cfg, row[cfg]["error_examples"])
        assert row[cfg]["proxy_cpu_ms_per_1k"] > 0
    assert rec.results["baseline"] == "HEAD"
    assert rec.results["traced_spans_received"] > 0
