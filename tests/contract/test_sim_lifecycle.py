"""Process behaviour: slots freed on disconnect, SIGTERM drain, injected faults."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from sim_harness import PD_CORES, Launcher, Pair, engine_env, port_open, start_pd

from epd_kit.sim.client import build_prompt, fake_image, pd_body, ve_body
from epd_kit.sim.errors import ENGINE_DEAD_MESSAGE
from epd_kit.wire import GenerateResponse


def text_body(max_tokens: int, stream: bool = False) -> dict:
    return {
        "request_id": f"t{max_tokens}",
        "token_ids": [5, 6, 7, 8],
        "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }


def abort_count(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_frees_the_slot_then_sigterm_drains(launcher: Launcher, checkpoint) -> None:
    pd = start_pd(launcher, str(checkpoint.path), max_num_seqs=1, env=engine_env(PD_CORES, decode_ms_per_token="20"))
    gen = pd.url + "/inference/v1/generate"
    # 1. A client that walks away mid-stream releases its (only) slot.
    with httpx.stream("POST", gen, json=text_body(2000, stream=True), timeout=10) as r:
        first = next(r.iter_bytes())
        assert first.startswith(b"data: ")
    t0 = time.monotonic()
    r = httpx.post(gen, json=text_body(3), timeout=10)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    assert time.monotonic() - t0 < 5  # not stuck behind 2000 x 20 ms
    assert abort_count(pd.url) == 1
    # 2. SIGTERM: the in-flight stream still completes, then the process exits 0.
    with httpx.stream("POST", gen, json=text_body(30, stream=True), timeout=10) as r:
        chunks = r.iter_bytes()
        body = next(chunks)
        pd.signal(signal.SIGTERM)
        body += b"".join(chunks)
    assert body.endswith(b"data: [DONE]\n\n")
    tokens = [
        t
        for line in body.split(b"\n\n")
        if line.startswith(b"data: {")
        for t in json.loads(line[6:])["choices"][0]["token_ids"]
    ]
    assert len(tokens) == 30
    assert pd.wait_exit(10) == 0
    assert not port_open(pd.port)
    assert "Shutdown complete (exit 0)" in pd.log()


def test_crash_after_n_requests(launcher: Launcher, checkpoint) -> None:
    pd = start_pd(launcher, str(checkpoint.path), env=engine_env(PD_CORES, crash_after="1"))
    gen = pd.url + "/inference/v1/generate"
    assert httpx.post(gen, json=text_body(2), timeout=10).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.post(gen, json=text_body(2), timeout=10)
    assert pd.wait_exit(10) == 1
    assert "simulated crash" in pd.log()


def _faults(url: str, **faults: object) -> None:
    r = httpx.put(url + "/sim/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


def test_runtime_faults_error_hang_latency(pair: Pair) -> None:
    gen = pair.pd.url + "/inference/v1/generate"
    try:
        _faults(pair.pd.url, error_rate=1.0)
        r = httpx.post(gen, json=text_body(2), timeout=10)
        assert r.status_code == 500 and "fault injection" in r.json()["error"]["message"]
        _faults(pair.pd.url, hang_after=0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gen, json=text_body(2), timeout=0.5)
        assert httpx.get(pair.pd.url + "/health").status_code == 200  # a hang is not death
        _faults(pair.pd.url, extra_latency_ms=300)
        t0 = time.monotonic()
        assert httpx.post(gen, json=text_body(2), timeout=10).status_code == 200
        assert time.monotonic() - t0 >= 0.3
        assert httpx.put(pair.pd.url + "/sim/faults", json={"error_rate": 2}).status_code == 400
    finally:
        _faults(pair.pd.url)
    assert httpx.post(gen, json=text_body(2), timeout=10).status_code == 200


def test_refused_side_channel_read_is_ec_load_failure(
    launcher: Launcher, pair: Pair, checkpoint, image_token_id
) -> None:
    pd = start_pd(launcher, str(checkpoint.path))
    a = fake_image((1, 8, 8), 201, checkpoint.vision)
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json=ve_body([a]), timeout=10)
    locs = GenerateResponse.model_validate(r.json()).ec_locators()
    prompt, phs = build_prompt([a], image_token_id)
    try:
        _faults(pair.ve.url, side_channel="refuse")
        t0 = time.monotonic()
        r = httpx.post(pd.url + "/inference/v1/generate", json=pd_body(prompt, [a], phs, locs), timeout=10)
        assert time.monotonic() - t0 < 0.9  # a refused READ fails fast, no timeout needed
    finally:
        _faults(pair.ve.url)
    # vLLM's EngineDeadError message, the cause in the log only; the process exits 0 (docs/sim.md "Real vLLM")
    assert r.status_code == 500 and r.json()["error"]["message"] == ENGINE_DEAD_MESSAGE
    assert pd.wait_exit(10) == 0
    assert "READ rejected by remote agent" in pd.log()
