"""The recommendation follows the verdict (issue 55): a named bottleneck whose requests queue
longer than they are served gets a change (or "add a host"), never "no change"; "no change" only
within both targets (busy and queueing, docs/advisor.md "Targets"), in words that agree with the
verdict. Reports recorded from runs on both sides of the line, and a property over generated ones."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_kit.advise.analysis import MIN_POOL_ARRIVALS, Analysis, PoolFigures, Stages
from epd_kit.advise.layout import Advisor, inventory_from_json
from epd_kit.advise.queueing import PoolModel, fit_service_time
from epd_kit.advise.report import analysis_lines, recommendation_lines
from epd_kit.advise.window import HistogramDelta
from tests.unit.advise.advise_scrapes import write_inventory

PD_SLOTS = 8
PREPROCESS_S = 0.02


def pool(role: str, engines: int, slots: int, rate: float, time_in_stage_s: float, seconds: float) -> PoolFigures:
    """A pool's figures as analyse() makes them: the service time fitted to the measured mean."""
    servers = engines * slots
    service = fit_service_time(rate, time_in_stage_s, servers)
    return PoolFigures(
        role=role,
        engines=engines,
        slots_per_engine=slots,
        arrivals=rate * seconds,
        time_in_stage_s=time_in_stage_s,
        model=PoolModel(rate, service, servers),
        inflight_mean=rate * time_in_stage_s,
        inflight_scraped=(0.0, 0.0),
        cap=None if role == "ve" else engines * 64,
    )


def recorded(
    ve: tuple[int, float, float],
    pd: tuple[int, float, float],
    seconds: float = 30.0,
    image_share: float = 1.0,
    pd_first_token_s: float = 0.03,
) -> Analysis:
    """A window from the figures a report prints: (engines, requests/s, time in stage s) per pool."""
    (ve_n, ve_rate, ve_time), (pd_n, pd_rate, pd_time) = ve, pd
    encode_s = ve_time * image_share
    ttft_s = PREPROCESS_S + encode_s + pd_first_token_s
    requests = pd_rate * seconds
    ttft = HistogramDelta(requests, ttft_s * requests, ())
    return Analysis(
        seconds=seconds,
        requests=requests,
        failed=0,
        rejections={},
        image_requests=ve_rate * seconds,
        stages=Stages(PREPROCESS_S, encode_s, pd_first_token_s, ttft_s),
        ttft=ttft,
        latency=ttft,
        pools={
            "ve": pool("ve", ve_n, 1, ve_rate, ve_time, seconds),
            "pd": pool("pd", pd_n, PD_SLOTS, pd_rate, pd_time, seconds),
        },
        preprocess_cache_hit=None,
        dedupe_share=None,
        engines={},
        min_requests=100,
    )


@functools.cache
def advisor(ve: int, pd: int, cores: int) -> Advisor:
    """One host n1 with `cores` NeuronCores (the sandbox's one-host: 24), VE tp4 and PD tp8."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = write_inventory(Path(tmp) / "inv.json", {"n1": (ve, pd)}, epd_core_count=cores)
        return Advisor(inventory_from_json(json.loads(path.read_text()), str(path)))


def report(analysis: Analysis, rec) -> str:
    return "\n".join(analysis_lines(analysis) + recommendation_lines(rec))


def test_the_ci_window_one_ve_68_percent_busy_queueing_twice_service_gets_a_second_ve():
    # issue 55's failing CI run of tests/e2e/test_one_host.py on a loaded machine: one VE 68 %
    # busy, 0.253 s queueing in front of it vs 0.118 s service, 89 % of TTFT in encode. The
    # report recommended no change ("at or under the 70% target"): the verdict and the advice
    # disagreed. M/M/1: 5.76 images/s x 0.118 s = 68 %, time in stage 0.118 / (1 - 0.68) = 0.371 s.
    analysis = recorded(ve=(1, 5.76, 0.371), pd=(2, 5.76, 0.09))
    ve = analysis.pools["ve"]
    assert ve.busy == pytest.approx(0.68, abs=0.005) and ve.model.service_s == pytest.approx(0.118, abs=0.001)
    assert ve.queueing_s == pytest.approx(0.253, abs=0.001)
    assert analysis.stages.shares()["encode"] == pytest.approx(0.89, abs=0.01)
    assert analysis.bottleneck == "ve"
    rec = advisor(1, 2, 24).recommend(analysis)
    assert rec.action == "change"
    assert rec.inventory_change() == ["n1: epd_num_ve 1 -> 2, epd_num_pd 2 -> 2"]  # the 4 spare cores
    assert "requests wait 0.253 s in front of the VE pool, 2.1x its 0.118 s service" in rec.reason
    # the predicted effect: busy halves, the queueing nearly goes, TTFT falls by about that
    assert rec.after.ve.utilisation == pytest.approx(ve.busy / 2)
    assert rec.after.ve.queueing_s < 0.2 * ve.queueing_s
    assert rec.predicted_ttft_s == pytest.approx(analysis.stages.ttft_s - (ve.queueing_s - rec.after.ve.queueing_s))
    text = report(analysis, rec)
    assert "the VE pool bounds latency and throughput" in text
    assert "recommendation: change the layout" in text and "no change" not in text
    assert f"TTFT mean {analysis.stages.ttft_s:.3f} -> {rec.predicted_ttft_s:.3f} s" in text
    assert "queueing in front of VE 0.253 -> " in text


def test_one_ve_under_the_busy_target_but_queueing_over_service_is_acted_on():
    # 55 % busy: under the 70 % busy target, but one server queues 1.2x its service (M/M/1:
    # queueing share = busy fraction), over the 50 % queueing target
    analysis = recorded(ve=(1, 5.5, 0.1 / 0.45), pd=(2, 5.5, 0.09))
    assert analysis.pools["ve"].busy == pytest.approx(0.55, abs=0.005)
    rec = advisor(1, 2, 24).recommend(analysis)
    assert rec.action == "change" and rec.proposed.counts == {"n1": (2, 2)}
    assert "over the 50% queueing target" in rec.reason and "busy, over the 70% target" not in rec.reason
    # a lower queueing target is the operator's choice too: 0.6 leaves this pool alone
    rec = advisor(1, 2, 24).recommend(analysis, target_queueing=0.6)
    assert rec.action == "none" and "within the 70% busy and 60% queueing targets" in rec.reason


def test_two_ves_60_percent_busy_queueing_under_service_is_left_alone_in_words_that_agree():
    # the other side of the line: M/M/2 at 60 % queues 0.56x its service (36 % of the time in
    # stage); the verdict still names the VE pool, and the no-change says why
    service = 0.118
    rate = 0.6 * 2 / service
    analysis = recorded(ve=(2, rate, service * 1.5625), pd=(2, rate, 0.09))
    ve = analysis.pools["ve"]
    assert ve.busy == pytest.approx(0.6, abs=0.01) and ve.queueing_share < 0.5
    assert analysis.bottleneck == "ve"
    rec = advisor(2, 2, 24).recommend(analysis)
    assert rec.action == "none" and not rec.changed
    text = report(analysis, rec)
    assert "the VE pool bounds latency and throughput" in text
    assert "recommendation: no change (the VE pool bounds throughput, but it is 60% busy" in text
    assert "within the 70% busy and 50% queueing targets" in text


def test_one_ve_under_half_busy_is_no_bottleneck_and_no_change():
    analysis = recorded(ve=(1, 4.0, 0.1 / 0.6), pd=(2, 4.0, 0.09))  # 40 % busy: queueing 0.67x service
    assert analysis.bottleneck is None
    rec = advisor(1, 2, 24).recommend(analysis)
    assert rec.action == "none"
    assert rec.reason.startswith("no pool is busy")


def test_a_full_host_whose_one_ve_queues_says_add_a_host():
    # 20 cores hold 1 VE + 2 PD exactly, and a PD pool of 2 keeps its floor: no layout of this
    # host helps, so the advice is another host, not "no change"
    analysis = recorded(ve=(1, 5.76, 0.371), pd=(2, 5.76, 0.09))
    rec = advisor(1, 2, 20).recommend(analysis)
    assert rec.action == "add a host" and not rec.changed
    assert "requests wait 0.253 s in front of the VE pool" in rec.reason and rec.reason.endswith("add a host")
    assert "recommendation: add a host (" in "\n".join(recommendation_lines(rec))


LAYOUTS = [(1, 2, 24), (2, 2, 24), (1, 1, 64), (1, 2, 20), (3, 2, 28)]


@st.composite
def reports(draw) -> tuple[tuple[int, int, int], Analysis]:
    layout = draw(st.sampled_from(LAYOUTS))
    ve_n, pd_n, _ = layout
    seconds = draw(st.sampled_from([20.0, 60.0, 300.0]))
    rate = draw(st.floats(min_value=150 / seconds, max_value=60.0))
    share = draw(st.floats(min_value=0.0, max_value=1.0))
    ve_time = draw(st.floats(min_value=0.005, max_value=3.0))
    pd_time = draw(st.floats(min_value=0.01, max_value=5.0))
    analysis = recorded(ve=(ve_n, rate * share, ve_time), pd=(pd_n, rate, pd_time), seconds=seconds, image_share=share)
    return layout, analysis


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reports())
def test_a_bottleneck_that_queues_longer_than_it_serves_is_never_left_without_advice(generated):
    layout, analysis = generated
    rec = advisor(*layout).recommend(analysis)
    assert rec is not None  # every generated window holds >= 100 requests
    waiting = [
        p for p in analysis.pools.values() if p.arrivals >= MIN_POOL_ARRIVALS and p.queueing_s > p.model.service_s
    ]
    if analysis.bottleneck is not None and waiting:
        assert rec.action != "none", report(analysis, rec)
    if rec.action == "none":
        # "no change" only within both targets, and then in words that do not contradict the verdict
        assert rec.before.busiest <= rec.target or analysis.bottleneck is None, report(analysis, rec)
        assert not analysis.waiting() or analysis.bottleneck is None, report(analysis, rec)
        if analysis.bottleneck is not None:
            assert "bounds throughput, but" in rec.reason and "within the" in rec.reason
    if rec.action == "change":
        assert rec.after.busiest < rec.before.busiest or rec.after.most_queueing < rec.before.most_queueing
