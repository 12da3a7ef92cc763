"""Rollout batches (docs/benchmarks.md "Rollout batches"): the wall-clock of a rolling restart
of every engine, one at a time against PD batches of 2 (VE batches of 1), on the four-host
sandbox fleet of tests/e2e/test_day2.py (n1 2 VE, n2 2 PD, n4 1 PD, n3 the router), under
bounded load with 0 failed requests required (the same load and checks as that test).

    scripts/test.sh bench/rollout_batches.py                      # one round of each, ~6 min
    EPD_BENCH_ROUNDS=3 scripts/test.sh bench/rollout_batches.py   # rounds alternate the modes

It needs the test hosts, so it runs through the test command (inside the kithub namespace, with
the machine-wide test-host lock) as a pytest module that the suite never collects (testpaths =
tests). The figures are printed and written to <kit dir>/bench-rollout-batches.json."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import engine_pids, four_host_fleet, restarted, under_load
from tests.hosts.fixtures import host_pool  # noqa: F401 - the fixture, outside tests/ (no conftest here)
from tests.hosts.harness import hosts_env

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(3600)]

MODES = {"one at a time": (), "PD batches of 2, VE batches of 1": ("-e", "epd_rollout_batch_pd=2")}
ROUNDS = int(os.environ.get("EPD_BENCH_ROUNDS", "1"))


def test_rolling_restart_one_at_a_time_vs_batched(host_pool, tmp_path):  # noqa: F811 - the imported fixture
    assert 1 <= ROUNDS <= 5, "EPD_BENCH_ROUNDS: 1..5 (each round is two rolling restarts under load)"
    timings: dict[str, float] = {}
    stack = deploy_stack(host_pool, four_host_fleet(tmp_path / "inventory").directory, timings.__setitem__, "bench")
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(ROUNDS):
        for mode, args in MODES.items():
            before = engine_pids(stack)
            result, elapsed = under_load(stack, "playbooks/rolling_restart.yml", *args)
            assert restarted(before, engine_pids(stack)) == set(before), (mode, result.describe())
            seconds[mode].append(round(elapsed, 1))
    report = {
        "engines": len(engine_pids(stack)),
        "rounds": ROUNDS,
        "seconds": seconds,
        "median_s": {mode: statistics.median(values) for mode, values in seconds.items()},
        "first_deploy_s": round(next(v for k, v in timings.items() if "first deploy" in k), 1),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(report, indent=2))
    (Path(hosts_env()["KIT_DIR"]) / "bench-rollout-batches.json").write_text(json.dumps(report, indent=2))
