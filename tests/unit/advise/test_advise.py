"""The layout advisor on saved scrapes of purpose-built imbalance (docs/advisor.md)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from epd_kit.advise.queueing import erlang_c, fit_service_time, mean_time_in_system
from epd_kit.advise.scrape import ScrapeError, parse_text
from epd_kit.advise.window import Window
from epd_kit.cli import main
from tests.unit.advise.advise_scrapes import Load, run_advise, write_inventory, write_scrapes

WINDOW = 120.0


def advise(tmp_path, load: Load, hosts: dict[str, tuple[int, int]], *extra: str, **group_vars) -> tuple[dict, str]:
    before, after = write_scrapes(load, tmp_path / "scrapes")
    inventory = write_inventory(tmp_path / "inv.json", hosts, **group_vars)
    return run_advise(before, after, load.seconds, inventory, *extra)


def test_image_heavy_with_too_few_ves_recommends_more_ves(tmp_path):
    # 2 VEs encode 18 image requests/s of 0.09 s each (81% busy); 7 PDs x 8 slots are 36% busy
    load = Load(rate=20, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=2, num_pd=7, cache_hit_share=0.25)
    doc, text = advise(tmp_path, load, {"n1": (2, 7)})
    assert doc["bottleneck"] == "ve"
    assert "caches: router preprocess cache hit 25%; in-request duplicates 0%" in text  # the one model's
    assert doc["pools"]["ve"]["busy"] == pytest.approx(0.81, abs=0.08)
    assert doc["pools"]["ve"]["service_s"] == pytest.approx(0.09, rel=0.15)
    assert doc["pools"]["ve"]["queueing_s"] > 0.05
    rec = doc["recommendation"]
    assert rec["changed"]
    # the host is full: a third VE takes one PD's 8 cores (2 changes), VE ~54 %, PD ~42 %
    assert rec["proposed"]["n1"] == [3, 6]
    assert rec["engine_changes"] == 2
    assert max(rec["predicted_busy"].values()) <= 0.70
    assert "n1: epd_num_ve 2 -> 3, epd_num_pd 7 -> 6" in text
    assert "epd-ve-2" in text and "epd-ve-3" not in text  # the planner's table of the new layout
    assert "the VE pool bounds latency" in text


def test_one_busy_ve_of_1e1pd_gets_one_more_ve_not_every_free_core(tmp_path):
    # issue 35: one VE 82 % busy on a 64-core host with 52 free cores. A second VE brings the
    # VE pool to ~41 %; the advisor recommended 14 VEs (every free core) before.
    load = Load(rate=10, image_share=0.9, ve_service_s=0.091, pd_service_s=0.3, num_ve=1, num_pd=1)
    doc, text = advise(tmp_path, load, {"n1": (1, 1)})
    assert doc["bottleneck"] == "ve"
    assert doc["pools"]["ve"]["busy"] == pytest.approx(0.82, abs=0.08)
    rec = doc["recommendation"]
    assert rec["proposed"] == {"n1": [2, 1]}, rec
    assert rec["inventory_change"] == ["n1: epd_num_ve 1 -> 2, epd_num_pd 1 -> 1"]
    assert rec["engine_changes"] == 1
    assert rec["predicted_busy"]["ve"] == pytest.approx(doc["pools"]["ve"]["busy"] / 2)
    # headroom: the load can grow until the VE pool reaches 70 %; then a third VE
    assert rec["headroom"] == pytest.approx(0.70 / rec["predicted_busy"]["ve"])
    assert rec["next_step"]["at_load"] == pytest.approx(rec["headroom"])
    assert rec["next_step"]["inventory_change"] == ["n1: epd_num_ve 2 -> 3, epd_num_pd 1 -> 1"]
    assert f"the load can grow {rec['headroom']:.2f}x" in text
    assert "next step, past that load: n1: epd_num_ve 2 -> 3, epd_num_pd 1 -> 1" in text
    # a lower target takes the fewest engines that bring both pools under it (PD 37 % -> 19 %)
    doc, _ = advise(tmp_path, load, {"n1": (1, 1)}, "--target-busy", "0.3")
    assert doc["recommendation"]["proposed"] == {"n1": [3, 2]}
    assert doc["recommendation"]["target_busy"] == 0.3


def test_a_load_that_needs_several_ves_gets_them_and_one_past_the_host_fills_it(tmp_path):
    # 4.5 Erlangs of encoding on 4 VEs (the queue grows): over 90 % busy, 5 VEs stay over 72 %,
    # 6 (two changes) are the fewest at or under 70 %
    load = Load(rate=10, image_share=0.9, ve_service_s=0.5, pd_service_s=0.1, num_ve=4, num_pd=1)
    doc, _ = advise(tmp_path, load, {"n1": (4, 1)})
    assert doc["pools"]["ve"]["busy"] > 0.9
    rec = doc["recommendation"]
    assert rec["proposed"] == {"n1": [6, 1]}, rec
    assert rec["engine_changes"] == 2
    assert rec["predicted_busy"]["ve"] <= 0.70
    # 10 VEs ~98 % busy against a 50 % target: the host's 14 VEs cannot reach it, so the
    # advisor takes the least busy layout, which needs every free core
    load = Load(rate=10, image_share=0.9, ve_service_s=1.09, pd_service_s=0.1, num_ve=10, num_pd=1)
    doc, text = advise(tmp_path, load, {"n1": (10, 1)}, "--target-busy", "0.5")
    rec = doc["recommendation"]
    assert rec["proposed"] == {"n1": [14, 1]}, rec
    assert rec["predicted_busy"]["ve"] > 0.5 and rec["headroom"] < 1
    assert "more hosts reach the target" in rec["reason"]
    assert "headroom: none" in text and "the load needs more hosts" in text


def test_text_only_load_on_a_ve_heavy_layout_moves_cores_to_pd(tmp_path):
    # no images: 8 idle VEs; 4 PDs x 8 slots carry 24 of 32 slots
    load = Load(rate=12, image_share=0.0, ve_service_s=0.09, pd_service_s=2.0, num_ve=8, num_pd=4)
    doc, _ = advise(tmp_path, load, {"n1": (8, 4)})
    assert doc["bottleneck"] == "pd"
    assert doc["pools"]["ve"]["busy"] == 0
    rec = doc["recommendation"]
    ve, pd = rec["proposed"]["n1"]
    assert pd > 4 and ve >= 1  # a VE stays: the fleet is not epd_text_only
    assert rec["predicted_busy"]["pd"] < doc["pools"]["pd"]["busy"]


def test_balanced_layout_is_left_alone(tmp_path):
    # VE 45% busy, PD 50%: any move of 8 cores makes one pool busier than both are now
    load = Load(rate=20, image_share=0.9, ve_service_s=0.1, pd_service_s=1.2, num_ve=4, num_pd=6)
    doc, text = advise(tmp_path, load, {"n1": (4, 6)})
    assert doc["enough_traffic"]
    assert not doc["recommendation"]["changed"]
    assert doc["recommendation"]["inventory_change"] == []
    assert "recommendation: no change" in text


def test_too_little_traffic_recommends_nothing(tmp_path):
    load = Load(rate=0.3, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=2, num_pd=7)
    doc, text = advise(tmp_path, load, {"n1": (2, 7)})
    assert not doc["enough_traffic"]
    assert doc["recommendation"] is None
    assert doc["bottleneck"] is None
    assert "too little traffic" in text
    assert "recommendation: none" in text


def test_the_recommendation_respects_faulted_cores_and_floors(tmp_path):
    # cores 32-63 faulted leave 32: the new layout must fit in 0-31
    load = Load(rate=10, image_share=0.9, ve_service_s=0.2, pd_service_s=1.0, num_ve=2, num_pd=3)
    doc, text = advise(tmp_path, load, {"n1": (2, 3)}, "--faulted", "n1=" + ",".join(map(str, range(32, 64))))
    assert doc["recommendation"]["changed"], doc
    ve, pd = doc["recommendation"]["proposed"]["n1"]
    assert ve * 4 + pd * 8 <= 32 and ve >= 1 and pd >= 1
    assert "faulted 32-63" in text


def test_two_hosts_stay_within_each_hosts_cores(tmp_path):
    load = Load(rate=30, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=3, num_pd=14)
    doc, _ = advise(tmp_path, load, {"n1": (2, 7), "n2": (1, 7)})
    proposed = doc["recommendation"]["proposed"]
    assert sum(v for v, _ in proposed.values()) > 3
    assert all(v * 4 + p * 8 <= 64 for v, p in proposed.values())


def test_inventory_that_does_not_plan_is_refused_before_scraping(tmp_path):
    before = tmp_path / "b.prom"
    before.write_text("")
    inventory = write_inventory(tmp_path / "inv.json", {"n1": (9, 7)})  # 36 + 56 cores > 64
    result = CliRunner().invoke(
        main,
        ["advise", "--before", str(before), "--after", str(before), "--window", "60", "--inventory", str(inventory)],
    )
    assert result.exit_code == 2
    assert "does not plan" in result.output and "layout does not fit" in result.output


def test_one_source_only():
    result = CliRunner().invoke(main, ["advise", "--url", "http://127.0.0.1:1", "--prometheus", "http://127.0.0.1:2",
                                       "--window", "5", "--inventory", "."])  # fmt: skip
    assert result.exit_code == 2
    assert "exactly one source" in result.output


def test_a_router_restart_inside_the_window_is_refused():
    after = parse_text('# TYPE epd_router_requests counter\nepd_router_requests_total{status="200"} 3\n', "after")
    before = parse_text('# TYPE epd_router_requests counter\nepd_router_requests_total{status="200"} 9\n', "before")
    with pytest.raises(ScrapeError, match="restarted inside the window"):
        Window(before, after, 60).counter("epd_router_requests_total")


def test_erlang_c_matches_known_values():
    # M/M/1: P(wait) = rho; M/M/2 at a = 1: C = 1/3
    assert erlang_c(1, 0.7) == pytest.approx(0.7)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert mean_time_in_system(5, 0.1, 1) == pytest.approx(0.2)  # M/M/1: S / (1 - rho)
    assert math.isinf(mean_time_in_system(20, 0.1, 1))


def test_fit_inverts_the_model():
    for servers, rate, service in ((1, 5.0, 0.1), (4, 30.0, 0.1), (56, 20.0, 2.0)):
        w = mean_time_in_system(rate, service, servers)
        assert fit_service_time(rate, w, servers) == pytest.approx(service, rel=1e-6)


def test_a_pool_keeps_its_rollout_floor(tmp_path):
    # the sandbox's one host: 24 cores, 1 VE + 2 PD. 4 VE + 1 PD would balance the load best,
    # but a PD pool of 2 keeps 1 in rotation while it rolls: 1 PD cannot, so 2 VE + 2 PD.
    load = Load(rate=10, image_share=0.9, ve_service_s=0.09, pd_service_s=0.3, num_ve=1, num_pd=2)
    doc, _ = advise(tmp_path, load, {"n1": (1, 2)}, epd_core_count=24)
    assert doc["recommendation"]["proposed"]["n1"] == [2, 2]


def test_min_available_from_the_inventory_is_respected(tmp_path):
    # the image-heavy case would move PD cores to VEs (above); a floor of 6 PDs that must still
    # roll one at a time keeps 7
    load = Load(rate=20, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=2, num_pd=7)
    doc, _ = advise(tmp_path, load, {"n1": (2, 7)}, epd_rollout_min_available_pd=6)
    assert doc["recommendation"]["proposed"]["n1"][1] >= 7


def test_an_inventory_the_planner_refuses_is_refused_with_the_planners_reason(tmp_path):
    load = Load(rate=20, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=2, num_pd=7)
    before, after = write_scrapes(load, tmp_path / "scrapes")
    inventory = write_inventory(tmp_path / "inv.json", {"n1": (2, 7)}, epd_rollout_min_available_pd="100%")
    args = ["advise", "--before", str(before), "--after", str(after), "--window", str(load.seconds)]
    args += ["--inventory", str(inventory)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "the inventory does not plan" in result.output
    assert "epd_rollout_min_available_pd: keeping 7 of the 7 PD engines" in result.output


def test_live_scrapes_of_two_routers_are_summed_and_saved(tmp_path):
    # two routers (127.0.0.1 stubs serving saved scrapes: first `before`, then `after`) each
    # carry half of the load: together they are the image-heavy case
    load = Load(rate=10, image_share=0.9, ve_service_s=0.09, pd_service_s=1.0, num_ve=1, num_pd=7, seed=3)
    before, after = write_scrapes(load, tmp_path / "scrapes")
    texts = [before.read_text(), after.read_text()]
    servers = [_serve_in_turn(texts), _serve_in_turn(texts)]
    inventory = write_inventory(tmp_path / "inv.json", {"n1": (1, 7)})
    urls = [arg for server in servers for arg in ("--url", f"http://127.0.0.1:{server.server_port}")]
    try:
        result = CliRunner().invoke(
            main,
            [
                "advise",
                *urls,
                "--window",
                "0.2",
                "--inventory",
                str(inventory),
                "--save",
                str(tmp_path / "saved"),
                "--json",
            ],
        )
    finally:
        for server in servers:
            server.shutdown()
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["requests"] == 2 * parse_requests(texts)  # both routers' counters add up
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "after-0.prom",
        "after-1.prom",
        "before-0.prom",
        "before-1.prom",
    ]


def parse_requests(texts: list[str]) -> float:
    name = "epd_router_requests_total"
    return parse_text(texts[1], "after").total(name) - parse_text(texts[0], "before").total(name)


def _serve_in_turn(texts: list[str]):
    """A 127.0.0.1 HTTP server answering GET /metrics with texts[0], then texts[1], ..."""
    import http.server
    import threading

    answers = iter(texts)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(answers).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_prometheus_instant_queries_are_summed_over_targets(monkeypatch):
    from epd_kit.advise import scrape

    asked = []

    class Reply:
        status_code = 200
        text = ""

        def __init__(self, at: float) -> None:
            self._at = at

        def json(self):
            value = "5" if self._at < 1000 else "25"
            series = []
            for instance, host in (("10.0.0.5:18800", "r1"), ("10.0.0.6:18800", "r2")):
                labels = {"__name__": "epd_router_requests_total", "status": "200", "job": "epd-router"}
                series.append({"metric": {**labels, "instance": instance, "host": host}, "value": [self._at, value]})
            return {"status": "success", "data": {"resultType": "vector", "result": series}}

    def fake_get(url, params, timeout, trust_env):
        asked.append((url, params))
        return Reply(float(params["time"]))

    monkeypatch.setattr("httpx.get", fake_get)
    before, after = scrape.prometheus_at("http://prom:9090", 900), scrape.prometheus_at("http://prom:9090", 1500)
    assert asked[0][0] == "http://prom:9090/api/v1/query"
    assert asked[0][1]["query"] == scrape.PROMETHEUS_SELECTOR
    assert Window(before, after, 600).counter("epd_router_requests_total") == 40  # (25 - 5) x 2 routers


def _engine_page(requests: int, waits: list[float], role: str | None) -> str:
    """A vLLM engine's /metrics (the families and labels real vLLM exports: tests/real_engines/recorded)."""
    labels = 'engine="0",model_name="m"' + (f',role="{role}"' if role else "")
    lines = [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{labels},finished_reason="length"}} {requests}',
        "# TYPE vllm:request_queue_time_seconds histogram",
    ]
    for bound in ("0.1", "1.0", "+Inf"):
        count = sum(1 for w in waits if bound == "+Inf" or w <= float(bound))
        lines.append(f'vllm:request_queue_time_seconds_bucket{{{labels},le="{bound}"}} {count}')
    lines += [
        f"vllm:request_queue_time_seconds_count{{{labels}}} {len(waits)}",
        f"vllm:request_queue_time_seconds_sum{{{labels}}} {sum(waits)}",
    ]
    return "\n".join(lines) + "\n"


def test_engine_figures_come_from_vllms_own_series(tmp_path):
    """Engines scraped with --engine-url (no role label) are summed; the report says so."""
    load = Load(rate=4, image_share=0.5, ve_service_s=0.05, pd_service_s=0.2, num_ve=1, num_pd=1)
    before, after = write_scrapes(load, tmp_path / "scrapes")
    pages = {"before": [_engine_page(2, [0.0, 0.0], None), _engine_page(5, [0.1] * 5, None)]}
    pages["after"] = [_engine_page(12, [0.0] * 2 + [0.5] * 10, None), _engine_page(9, [0.1] * 9, None)]
    files: dict[str, list[str]] = {"before": [str(before)], "after": [str(after)]}
    for name, texts in pages.items():
        for index, text in enumerate(texts):
            path = tmp_path / f"{name}-engine-{index}.prom"
            path.write_text(text)
            files[name].append(str(path))
    inventory = write_inventory(tmp_path / "inv.json", {"n1": (1, 1)})
    args = ["advise", "--window", str(load.seconds), "--inventory", str(inventory)]
    for name in ("before", "after"):
        for path in files[name]:
            args += [f"--{name}", path]
    runner = CliRunner()
    out = runner.invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    engines = json.loads(out.output)["engines"]
    assert list(engines) == ["all"]
    assert engines["all"]["requests"] == (12 - 2) + (9 - 5)
    assert engines["all"]["queue_wait_s"] == pytest.approx((10 * 0.5 + 4 * 0.1) / 14)
    text = runner.invoke(main, args).output
    assert (
        "engines (vLLM's own series): all scraped 14 requests finished, mean wait in the engine's queue 0.386 s" in text
    )
    # without engine pages the report says how to add them
    bare = ["advise", "--window", str(load.seconds), "--inventory", str(inventory), "--before", str(before)]
    bare += ["--after", str(after)]
    assert "engines: not scraped (add --engine-url for the VEs and PDs)" in runner.invoke(main, bare).output


def test_engine_figures_are_split_by_role_when_prometheus_labels_them():
    from epd_kit.advise.analysis import analyse

    router = '# TYPE epd_router_requests_total counter\nepd_router_requests_total{status="200"} 1\n'
    before = parse_text(router + _engine_page(0, [], "ve") + _engine_page(0, [], "pd").replace("# TYPE", "# X"), "b")
    after_text = router + _engine_page(3, [0.2] * 3, "ve") + _engine_page(4, [1.0] * 4, "pd").replace("# TYPE", "# X")
    analysis = analyse(Window(before, parse_text(after_text, "a"), 60), pd_slots=8)
    assert {role: (e.requests, e.queue_wait.mean) for role, e in analysis.engines.items()} == {
        "ve": (3, pytest.approx(0.2)),
        "pd": (4, pytest.approx(1.0)),
    }


def test_an_engine_restart_inside_the_window_leaves_its_figures_out():
    from epd_kit.advise.analysis import analyse

    router = '# TYPE epd_router_requests_total counter\nepd_router_requests_total{status="200"} 1\n'
    before = parse_text(router + _engine_page(9, [0.1] * 9, None), "b")
    after = parse_text(router + _engine_page(2, [0.1] * 2, None), "a")  # restarted: counts from 0
    analysis = analyse(Window(before, after, 60), pd_slots=8)
    assert analysis.engines == {}
    assert "an engine restarted inside the window" in " ".join(analysis.notes)
