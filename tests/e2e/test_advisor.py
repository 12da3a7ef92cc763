"""The layout advisor in the sandbox (docs/advisor.md), on one deployment, tests in file order.

The one-host layout (1 VE + 2 PD on 24 cores) with a slow simulated VE (EPD_SIM_ENCODE_MS_PER_1K_PATCHES:
about 140 ms per 256x256 image) under image-heavy load (every request a new image, Poisson at 6 requests/s): the
advisor names the VE pool and recommends a second VE on the spare cores; deploy.yml applies it
under load with no failed request; the same load then spends less time in encode and the
advisor recommends no change; an idle window is "too little traffic". Load and windows are
bounded; all traffic goes to the test host n1 (10.213.0.11)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import LoadGenerator, Stack, image_data_url, is_healthy
from tests.hosts.harness import REPO, HostPool, ansible_playbook, write_inventory

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(900)]

BASE = REPO / "inventory/sandbox/one-host"
RATE_PER_S = 6
WINDOW_S = 30
STEP_LIMIT_S = 300
# a 256x256 image is 256 patches of 16x16 (already a multiple of patch x merge = 32, so it is not
# resized): 3 + 560 x 256/1024 = 143 ms on the VE (sim/profile.py), so one VE is ~86% busy at
# 6 images/s and two are ~43%
ENCODE_MS_PER_1K_PATCHES = "560"
IMAGE_EDGE = 256


class NewImageLoad(LoadGenerator):
    """The bounded load generator, each request with an image never sent before (a VE cache miss),
    at Poisson arrivals: evenly spaced requests never queue in front of a VE that serves faster
    than the spacing, whatever its busy fraction."""

    @property
    def interval(self) -> float:
        return self._rng.expovariate(1 / self._mean_interval)

    @interval.setter
    def interval(self, value: float) -> None:
        self._mean_interval = value
        self._rng = random.Random(22)

    def body(self, n: int) -> dict:
        return {
            "model": self.model,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": image_data_url((n % 256, n // 256 % 256, 77), IMAGE_EDGE)},
                        },
                        {"type": "text", "text": f"request {n}: what is in the picture?"},
                    ],
                }
            ],
        }


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory) -> Path:
    hosts_yml = yaml.safe_load((BASE / "hosts.yml").read_text())
    base_vars = yaml.safe_load((BASE / "group_vars/all/epd.yml").read_text())
    environment = {**base_vars["epd_engine_environment"], "EPD_SIM_ENCODE_MS_PER_1K_PATCHES": ENCODE_MS_PER_1K_PATCHES}
    directory = tmp_path_factory.mktemp("advisor") / "inventory"
    return write_inventory(directory, BASE, hosts_yml, {"epd_engine_environment": environment})


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, fleet_dir: Path, record_timing) -> Iterator[Stack]:
    return deploy_stack(host_pool, fleet_dir, record_timing, "advisor (1 VE + 2 PD)")


@pytest.fixture(scope="module")
def seen() -> dict:
    """What earlier tests of this module measured."""
    return {}


def advise(stack: Stack, fleet_dir: Path, window_s: float) -> dict:
    env = dict(os.environ, PATH=f"{REPO / '.venv/bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    argv = [str(REPO / ".venv/bin/epd-router"), "advise", "--url", stack.router_url, "--window", str(window_s)]
    argv += ["--inventory", str(fleet_dir), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=window_s + 120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def advise_under_load(stack: Stack, fleet_dir: Path) -> dict:
    with NewImageLoad(
        stack.router_url, stack.model_id(), rate_per_s=RATE_PER_S, max_requests=RATE_PER_S * 60, max_seconds=60
    ) as load:
        time.sleep(3)  # past the start: the window sees a steady load
        doc = advise(stack, fleet_dir, WINDOW_S)
        outcome = load.stop()
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    return doc


def test_image_heavy_load_on_one_ve_names_the_ve_pool_and_recommends_a_second_ve(stack, fleet_dir, seen, record_timing):
    doc = advise_under_load(stack, fleet_dir)
    seen["before"] = doc
    record_timing("advisor: 1E2PD TTFT p50 (router)", doc["ttft_p50_s"])
    record_timing("advisor: 1E2PD TTFT p99 (router)", doc["ttft_p99_s"])
    assert doc["enough_traffic"], doc["confidence"]
    assert doc["bottleneck"] == "ve", doc["verdict"]
    rec = doc["recommendation"]
    assert rec["changed"], doc
    assert rec["proposed"] == {"n1": [2, 2]}  # the 4 spare cores; a PD pool of 2 keeps its floor
    assert rec["inventory_change"] == ["n1: epd_num_ve 1 -> 2, epd_num_pd 2 -> 2"]


def test_the_recommendation_deploys_under_load_without_a_failed_request(stack, fleet_dir, seen, record_timing):
    assert seen.get("before"), "needs the first test's recommendation"
    hosts_yml = yaml.safe_load((fleet_dir / "hosts.yml").read_text())
    hosts_yml["all"]["children"]["epd_engines"]["hosts"]["n1"]["epd_num_ve"] = 2
    (fleet_dir / "hosts.yml").write_text(yaml.safe_dump(hosts_yml, sort_keys=False))
    with NewImageLoad(
        stack.router_url,
        stack.model_id(),
        rate_per_s=RATE_PER_S,
        max_requests=RATE_PER_S * STEP_LIMIT_S,
        max_seconds=STEP_LIMIT_S,
    ) as load:
        time.sleep(2)
        start = time.monotonic()
        result = ansible_playbook(fleet_dir, "playbooks/deploy.yml", timeout=STEP_LIMIT_S)
        record_timing("advisor: deploy of the recommendation under load", time.monotonic() - start)
        time.sleep(2)
        outcome = load.stop()
    assert result.returncode == 0, result.describe()
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    ves = [e for e in stack.pools() if e["id"].startswith("epd-ve-")]
    assert len(ves) == 2 and all(is_healthy(e) and e["state"] == "active" for e in ves), ves


def test_after_the_change_encode_time_falls_and_no_change_is_recommended(stack, fleet_dir, seen, record_timing):
    before = seen.get("before")
    assert before, "needs the first test's figures"
    doc = advise_under_load(stack, fleet_dir)
    record_timing("advisor: 2E2PD TTFT p50 (router)", doc["ttft_p50_s"])
    record_timing("advisor: 2E2PD TTFT p99 (router)", doc["ttft_p99_s"])
    assert doc["pools"]["ve"]["engines"] == 2
    # the predicted direction: queueing in front of the VE pool shrinks (the bench measures the size)
    assert doc["pools"]["ve"]["time_in_stage_s"] < 0.8 * before["pools"]["ve"]["time_in_stage_s"], (before, doc)
    assert doc["pools"]["ve"]["busy"] < before["pools"]["ve"]["busy"]
    assert doc["ttft_p50_s"] < before["ttft_p50_s"], (before, doc)
    assert doc["recommendation"] is not None and not doc["recommendation"]["changed"], doc


def test_an_idle_window_is_too_little_traffic(stack, fleet_dir):
    doc = advise(stack, fleet_dir, 3)
    assert not doc["enough_traffic"]
    assert doc["recommendation"] is None
    assert "too little traffic" in doc["confidence"]
