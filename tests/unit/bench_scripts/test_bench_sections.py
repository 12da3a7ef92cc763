"""Smoke tests: every bench section runs end to end at a tiny size, so the harness cannot rot.

They check the numbers are sane (not just that nothing raised): hit rates within [0, ceiling
+ noise], the simulated PD policies finish every request, the preprocessing wire bytes match.
"""

from __future__ import annotations

import json

import pytest

from bench import pd_placement_sim, preprocess, ve_placement


def test_ve_placement_tiny(tmp_path):
    rec = ve_placement.main(
        ["--requests", "400", "--catalogue", "300", "--cache-items", "16", "--zipf", "1.2", "--out-dir", str(tmp_path)]
    )
    res = rec.results["by_zipf"]["1.2"]
    assert 0 < res["ceiling_hit_rate"] < 1
    names = list(res["policies"])
    assert any(n.startswith("ours") for n in names) and "reference HRW" in names
    for r in res["policies"].values():
        assert 0 <= r.hit_rate <= 1
        assert r.max_mean_items >= 1
        assert sum(r.items_per_ve) == res["items"]
    # reference HRW partitions content: never spills off its first choice
    assert res["policies"]["reference HRW"].spill_fraction == 0
    # the reference proxy's restart-at-0 sends every request's first item to ve-0
    rr0 = res["policies"]["round-robin from encoder 0 (vllm#52484)"]
    assert rr0.items_per_ve[0] == max(rr0.items_per_ve)
    saved = json.loads((tmp_path / "ve_placement.json").read_text())
    assert saved["machine"]["nproc"] >= 1 and (tmp_path / "bench-ve-placement.png").stat().st_size > 0


def test_pd_placement_sim_tiny(tmp_path):
    rec = pd_placement_sim.main(["--requests", "600", "--utilisation", "0.9", "--out-dir", str(tmp_path)])
    res = rec.results["0.9"]
    rr, lo = res["policies"].values()
    for r in (rr, lo):
        assert 0 < r.ttft_p50_ms <= r.ttft_p99_ms
        assert r.throughput_rps > 0
    assert rr.max_mean_requests == pytest.approx(1.0, abs=0.01)  # round-robin is count-fair


def test_preprocess_tiny(tmp_path):
    pytest.importorskip("transformers")
    rec = preprocess.main(
        [
            "--cold-images",
            "2",
            "--warm-images",
            "1",
            "--min-seconds",
            "0.05",
            "--warmup-images",
            "0",
            "--cpu",
            "",
            "--no-plot",
            "--out-dir",
            str(tmp_path),
        ]
    )
    for size in ("512x512", "1024x768"):
        r = rec.results["sizes"][size]
        assert r["wire_identical_images_checked"] >= 3
        assert r["warm_ours"]["images"] > 0 and r["cold_plain"]["images"] == 2
    assert rec.results["sizes"]["1024x768"]["grid_thw"][1] * rec.results["sizes"]["1024x768"]["grid_thw"][2] <= 1024


def test_pd_placement_http_tiny(tmp_path):
    from bench import pd_placement

    rec = pd_placement.main(
        [
            "--requests",
            "10",
            "--pds",
            "2",
            "--decode-ms",
            "0.2",
            "--prefill-ms-per-1k",
            "10",
            "--des-requests",
            "200",
            "--deadline-s",
            "20",
            "--no-plot",
            "--out-dir",
            str(tmp_path),
        ]
    )
    http = rec.results["http"]["policies"]
    for r in http.values():
        assert r.errors == 0, r.error_examples
        assert r.completed == 10 and r.wrong_lengths == 0  # ignore_eos: exact lengths
        assert sum(r.per_pd_requests) == 10
    assert http["round-robin (reference)"].per_pd_requests == [5, 5]
    pd_placement.plot(rec.results, tmp_path / "pd.png")  # the plot code, without a second run
    assert (tmp_path / "pd.png").stat().st_size > 0
