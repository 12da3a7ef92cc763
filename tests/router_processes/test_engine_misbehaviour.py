"""A misbehaving engine cannot hurt the router: a real router with a sim VE,
two sim PDs and bench/misbehaving_engine.py's raw-socket PD on 127.0.0.1, which misbehaves on
the requests of one client (and, in the /health cases, on every probe) while a legitimate
client's requests and /health are timed and the router's RSS is sampled. Each case: no answer
of 500, no traceback in the router log, legitimate p99 < 2 s, RSS growth < 50 MB, /health
bounded as test_hostile.py bounds it (median < 100 ms, worst probe < 1 s, no failed probe;
the bench keeps p99 < 100 ms as the goal), and what the misbehaviour client gets is what the
engine's answer must become (a 502 for a head over the cap or ids outside the vocabulary, a
429 with a sane Retry-After, a 200 through interim answers); ids outside the vocabulary are
charged to the bad engine. The bench runs the same cases longer (python -m bench.hostile
--engines; docs/benchmarks.md §8 "Misbehaving engine answers")."""

from __future__ import annotations

import pytest

from bench import misbehaving_engine as bad_engine

from .harness import Stack, wait_until

SECONDS = 3.0
HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2, "success_threshold": 1}
# a stopped PD misses `failure_threshold` probes of `timeout_s` each, an interval apart; 1 s slack
EJECTED_MAX_S = HEALTH["failure_threshold"] * (HEALTH["interval_s"] + HEALTH["timeout_s"]) + 1.0


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    with bad_engine.running() as bad:
        # one attempt per request: what the bad engine's answer becomes reaches its client
        s = Stack.start(
            ckpt, tmp_path_factory.mktemp("misbehaviour"), n_ve=1, n_pd=2, health=HEALTH, retries={"max_attempts": 1}
        )
        try:
            s.config["endpoints"]["pd"].append({"id": bad.name, "url": bad.url, "state": "active"})
            s.router.write_config(s.config)
            s.router.reload()
            wait_until(lambda: s.router.pools().get(bad.name, {}).get("healthy"), 15, "the bad engine serving")
            yield s, bad
        finally:
            s.stop()


@pytest.mark.parametrize("case", bad_engine.CASES, ids=lambda c: c.mode + ("-sigstop" if c.sigstop else ""))
def test_a_misbehaving_engine_hurts_neither_the_router_nor_other_clients(stack, case):
    s, bad = stack
    log_at = s.router.log_path.stat().st_size
    charged = s.router.pools()[bad.name]["failures"]
    pd1 = s.pds[1]
    figures = bad_engine.run_case(
        s.router.url, s.router.proc.pid, bad, case, SECONDS, stop_pd=(pd1.engine_id, pd1.proc.pid)
    )
    assert figures["pools_ready_s"] is not None, "a PD stayed ejected after the previous case"
    log = s.router.log()[log_at:]
    assert "Traceback" not in log, log[-3000:]
    # the bench's /health goal is p99 < 100 ms; here, beside other test lanes on a shared
    # machine (the CI: this tier at nice 5 beside two e2e lanes on 2 cores), p99 of ~100
    # samples failed once in five runs: the typical probe must stay fast and none may wait
    # behind the misbehaviour for a second (test_hostile.py's rule, as test_stream_integrity.py)
    problems = bad_engine.failures(case, figures, EJECTED_MAX_S)
    assert [p for p in problems if not p.startswith("/health")] == [], figures
    health = figures["/health"]
    assert health["p50_ms"] < 100 and health["max_ms"] < 1000 and figures["probe_failures"] == 0, figures
    if case.mode == "oov":  # the engine's invalid answer, charged to it (its /health readmits it)
        assert s.router.pools()[bad.name]["failures"] > charged, figures
    if case.mode == "header":  # named for what it is: the connection was fine (not "connection broken")
        assert "failed: the engine's answer" in log  # head longer than 64 KiB, or over 100 lines
        assert "connection broken (AnswerTooLarge)" not in log
