"""Issue 33 item 1: one VE whose side channel refuses reads (the sim's `refuse` fault, the
tutorial's missing-EFA-variable case) under load. A PD that fails a read loses its engine
core and exits (vLLM's behaviour, docs/contract.md §3.5), so the router must charge the VE
at the first failure, move the request onto another VE's blocks and never send that VE's
blocks to a PD again: the PD pool survives and, after the first failure, every client is
served. (Before: the retry re-encoded on the same VE, the next PD died too, then every
request got 503 "no healthy active PD".)

Every load loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from bench.hostile import Probe
from epd_kit.testing.images import image_part, png_data_url, user_message

from .harness import Stack, wait_until


@pytest.fixture
def stack(ckpt, tmp_path):
    s = Stack.start(ckpt, tmp_path, n_ve=2, n_pd=2)
    yield s
    s.stop()


def chat(url: str, messages: list[dict]) -> tuple[float, int]:
    t0 = time.monotonic()
    body = {"model": "m", "messages": messages, "max_tokens": 4}
    try:
        status = httpx.post(url + "/v1/chat/completions", json=body, timeout=30, trust_env=False).status_code
    except httpx.HTTPError:
        status = -1
    return t0, status


def image_request(i: int) -> list[dict]:
    return [user_message(f"Picture {i}: describe.", image_part(png_data_url(64, 64, seed=5000 + i)))]


def test_a_ve_that_refuses_reads_costs_at_most_one_pd(stack):
    url = stack.router.url
    # both VEs' blocks read by a PD first (distinct images spread over both)
    for i in range(8):
        assert chat(url, image_request(i))[1] == 200
    served = {e: p["served"] for e, p in stack.router.pools().items() if p["role"] == "ve"}
    assert all(served.values()), served

    results: dict[str, list[tuple[float, int]]] = {"text": [], "image": []}
    stop = threading.Event()

    def client(kind: str, seed: int) -> None:  # one request at a time, at most 400
        for i in range(400):
            if stop.is_set():
                return
            messages = [user_message(f"hello {i}")] if kind == "text" else image_request(seed + i)
            results[kind].append(chat(url, messages))

    clients = [
        threading.Thread(target=client, args=(k, 100 + n * 1000), daemon=True)
        for n, k in enumerate(["text", "text", "image"])
    ]
    probe = Probe(url)
    prober = threading.Thread(target=probe.run, args=(60,), daemon=True)
    for t in [*clients, prober]:
        t.start()
    try:
        time.sleep(0.5)
        broken = stack.ves[0]
        assert httpx.put(broken.url + "/sim/faults", json={"side_channel": "refuse"}, timeout=5).status_code == 200
        wait_until(lambda: stack.router.pools()[broken.engine_id]["quarantined_s"] > 0, 30, "the VE charged")
        charged = time.monotonic()
        time.sleep(4.0)  # the load goes on: images hashing to the broken VE move to the other
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)
        probe.stop()
        prober.join(timeout=10)

    pools = stack.router.pools()
    ve = pools[broken.engine_id]
    assert ve["healthy"] is False and ve["failures"] >= 1 and ve["quarantined_s"] > 0
    assert pools[stack.ves[1].engine_id]["healthy"] is True
    # one image request at a time: one PD at most lost its engine core, and none after the charge
    time.sleep(0.5)  # a PD that died exits after its dead-linger (0.2 s)
    exited = [pd.engine_id for pd in stack.pds if pd.proc is not None and pd.proc.poll() is not None]
    assert len(exited) <= 1, exited
    assert any(p["healthy"] for p in pools.values() if p["role"] == "pd")
    log = stack.router.log()
    assert log.count("VE quarantined") == 1
    # every request started after the charge was served, text and images alike
    after = {k: [s for t0, s in got if t0 > charged] for k, got in results.items()}
    assert len(after["image"]) >= 3 and len(after["text"]) >= 3, after
    assert all(s == 200 for got in after.values() for s in got), after
    assert all(s in (200, 502, 503) for got in results.values() for _, s in got)  # never a 500
    health = probe.summary()["/health"]
    assert health["p50_ms"] < 100 and health["max_ms"] < 1000 and probe.failures == 0, health
    assert "Traceback" not in log and "internal error" not in log
