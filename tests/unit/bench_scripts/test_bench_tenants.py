"""bench/tenants.py runs end to end at a tiny size (real sim engines and router on 127.0.0.1)
and its figures are sane: the calm tenant is served in every case, the noisy tenant over its
quota is refused with 429s, and nothing else is refused."""

from __future__ import annotations

from bench import tenants


def test_bench_tenants_tiny(tmp_path):
    rec = tenants.main(["--rounds", "1", "--seconds", "1", "--noisy-tokens-per-min", "60", "--out-dir", str(tmp_path)])
    results = rec.results
    assert list(results) == list(tenants.CASES)
    for case, figures in results.items():
        assert figures["calm_requests"] > 0 and figures["calm_errors"] == 0, (case, figures)
        assert figures["calm_p50_ms"] <= figures["calm_p99_ms"]
    assert results["calm alone"]["heavy_statuses"] == {}
    assert set(results["beside heavy load, no quota"]["heavy_statuses"]) == {"200"}
    for case in ("beside noisy over quota, honouring Retry-After", "beside noisy over quota, ignoring Retry-After"):
        assert results[case]["heavy_statuses"].get("429", 0) > 0, results[case]
    assert (tmp_path / "tenants.json").is_file()
