"""Real vLLM engines' /health and /metrics as the kit reads them: the router's probes, the
Prometheus targets of the kit's observability role (no credentials), the dashboard, the alert
rules and `epd-router advise` (docs/observability.md "Engine metrics the kit reads").

One real VE and PD behind the kit's router. The families both engines export are recorded per
vLLM version in tests/real_engines/recorded/ (the sim and the kit's queries are held to that
list by tests/unit/test_engine_metric_names.py, which needs no vLLM); refresh it with

    EPD_RECORD_METRICS=1 scripts/compat-env.sh pytest tests/real_engines/test_metrics.py
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.budget import scaled
from tests.metric_names import RECORDED, kit_reads, parse_families, read_recorded, render_recorded
from tests.unit.advise.advise_scrapes import write_inventory

from .conftest import REPO
from .stack import RealStack

RECORD = os.environ.get("EPD_RECORD_METRICS") == "1"
# the chats sent (bounded: 8 of 4 tokens): an image seed each, repeated; None: text only
SEEDS = (1, 2, 1, None, 2, 1, 2, None)
CHATS, TEXT_CHATS = len(SEEDS), SEEDS.count(None)
WINDOW_S = 10  # what advise is told; the figures checked do not depend on it
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def stack(ckpt, plugin_site, tmp_path_factory):
    one = RealStack.start(tmp_path_factory.mktemp("metrics"), ckpt, plugin_site)
    yield one
    one.stop()


def version() -> str:
    import vllm

    return vllm.__version__


def scrape(url: str) -> str:
    """GET /metrics as the kit's Prometheus job does: no credentials (docs/observability.md)."""
    answer = httpx.get(url + "/metrics", timeout=30, trust_env=False)
    assert answer.status_code == 200, answer.text[:300]
    return answer.text


def chat(stack: RealStack, seed: int | None) -> None:
    parts = ["Describe this."] if seed is None else [image_part(png_data_url(64, 48, seed=seed)), "Describe this."]
    body = {"model": str(stack.ckpt), "messages": [user_message(*parts)], "max_tokens": MAX_TOKENS}
    answer = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=180, trust_env=False)
    assert answer.status_code == 200, answer.text[:300]


@pytest.fixture(scope="module")
def traffic(stack):
    """Before/after scrapes of the router and both engines around the SEEDS chats: what
    `epd-router advise --before/--after` reads."""
    sources = {"router": stack.url, "ve": stack.ves[0].url, "pd": stack.pds[0].url}
    before = {name: scrape(url) for name, url in sources.items()}
    for seed in SEEDS:
        chat(stack, seed)
    after = {name: scrape(url) for name, url in sources.items()}
    return before, after


def test_the_engines_answer_health_and_metrics_without_the_key(stack):
    """The router's probes and the kit's Prometheus targets send no key: vLLM checks its key
    only under /v1, /v2 and /inference (docs/observability.md); the router's /health probes
    keep both engines in its pools."""
    for engine in stack.engines:
        assert httpx.get(engine.url + "/health", timeout=10, trust_env=False).status_code == 200
        assert "vllm:num_requests_running" in scrape(engine.url)
    assert {name: e["healthy"] for name, e in stack.pools().items()} == {"epd-ve-0": True, "epd-pd-0": True}


def test_the_recorded_metric_names_are_what_the_engines_export(stack, traffic):
    """tests/real_engines/recorded/vllm-<version>.txt is this vLLM's VE and PD families."""
    _, after = traffic
    live = {role: parse_families(after[role]) for role in ("ve", "pd")}
    path = RECORDED / f"vllm-{version()}.txt"
    if RECORD:
        path.write_text(render_recorded(version(), live))
    assert read_recorded(path) == live, f"refresh with EPD_RECORD_METRICS=1 ({__doc__.split('refresh with')[1]})"


def test_every_engine_metric_the_kit_reads_is_exported(traffic):
    """Every vllm:* name of the dashboard, the alert rules and the advisor is a family of the
    real engine of the role it is read from."""
    _, after = traffic
    live = {role: parse_families(after[role]) for role in ("ve", "pd")}
    for name, roles in kit_reads().items():
        for role in roles:
            assert name in live[role], f"{name} ({role}) is read by the kit but not exported by vLLM {version()}"


def test_advise_reports_the_real_engines_figures(stack, traffic, tmp_path):
    """`epd-router advise` on saved scrapes of the router and the real engines: the requests
    it counts are the ones sent, and the engine figures come from vLLM's own series."""
    before, after = traffic
    args = [str(REPO / ".venv" / "bin" / "epd-router"), "advise", "--window", str(WINDOW_S), "--json"]
    args += ["--min-requests", "1"]
    for name, texts in (("before", before), ("after", after)):
        for source, text in texts.items():
            path = tmp_path / f"{name}-{source}.prom"
            path.write_text(text)
            args += [f"--{name}", str(path)]
    inventory = write_inventory(tmp_path / "inventory.json", {"n1": (1, 1)})  # parsed only
    args += ["--inventory", str(inventory)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=scaled(120), check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["requests"] == CHATS
    assert round(report["pools"]["ve"]["rate_per_s"] * WINDOW_S) == CHATS - TEXT_CHATS  # the VE stage's arrivals
    # saved scrapes carry no `role` label: the engines' figures are summed ("all")
    engines = report["engines"]["all"]
    assert engines["requests"] == 2 * CHATS - TEXT_CHATS  # each chat on the PD, those with an image on the VE too
    assert 0 <= engines["queue_wait_s"] < 60
