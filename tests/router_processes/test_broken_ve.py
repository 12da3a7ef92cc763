"""One VE whose side channel refuses reads (the sim's `refuse` fault, the
tutorial's missing-EFA-variable case) under load. A PD that fails a read loses its engine
core and exits (vLLM's behaviour, docs/contract.md §3.5), so the router must charge the VE
at the first failure, move the request onto another VE's blocks and never send that VE's
blocks to a PD again: the PD pool survives and, after the first failure, every client is
served. (Before: the retry re-encoded on the same VE, the next PD died too, then every
request got 503 "no healthy active PD".)

The run is bench/hostile.py's `broken_ve_case` (python -m bench.hostile --random 0
--broken-ve). Every load loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import pytest

from bench import hostile

from .harness import Stack


@pytest.fixture
def stack(ckpt, tmp_path):
    s = Stack.start(ckpt, tmp_path, n_ve=2, n_pd=2)
    yield s
    s.stop()


def test_a_ve_that_refuses_reads_costs_at_most_one_pd(stack):
    broken = stack.ves[0]

    def alive() -> int:
        return sum(pd.proc is not None and pd.proc.poll() is None for pd in stack.pds)

    figures = hostile.broken_ve_case(stack.router.url, broken.url, broken.engine_id, alive, seconds=4.0)
    # the bench's /health goal is p99 < 100 ms; here, beside other test lanes on a shared
    # machine, p99 of ~20-90 samples is their maximum (188 ms once in a full tier run): the
    # typical probe must stay fast and none may wait behind the misbehaviour for a second
    # (test_hostile.py's rule)
    assert [p for p in figures["problems"] if not p.startswith("/health")] == [], figures
    health = figures["/health"]
    assert health["p50_ms"] < 100 and health["max_ms"] < 1000 and figures["probe_failures"] == 0, figures
    pools = stack.router.pools()
    ve = pools[broken.engine_id]
    assert ve["healthy"] is False and ve["failures"] >= 1 and ve["quarantined_s"] > 0
    assert pools[stack.ves[1].engine_id]["healthy"] is True
    assert any(p["healthy"] for p in pools.values() if p["role"] == "pd")
    log = stack.router.log()
    assert log.count("VE quarantined") == 1
    assert "Traceback" not in log and "internal error" not in log
