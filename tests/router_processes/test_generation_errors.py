"""vLLM's per-request generation error (a choice finished with reason "error", e.g. a KV load
failure) through a real router and real sim PDs answering as each release does: 0.24's 200
with the failed choice, 0.29's 500, and the stream's error event in both (docs/compat.md
"Generation errors"). The client gets a 502 or an error frame saying so; no PD is charged,
however many requests fail (with `failure_threshold` 2 a charged PD would be ejected after
two). An engine-wide 500 on the same stack still ejects its PD.

Every request loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import json

import httpx
import pytest

from .harness import RouterProc, Stack

CLIENT_MESSAGE = "the engine could not complete this request (generate: vLLM generation error)"
FAILING = 6  # requests that fail: three times failure_threshold


@pytest.fixture(scope="module", params=["0.24", "0.29"])
def engines(request, ckpt, tmp_path_factory):
    """A stack answering as one vLLM release, for both tests below (its three engines are ~1.4
    CPU-s to start), and how many tests it served."""
    env = {name: {"EPD_SIM_VLLM": request.param} for name in ("epd-ve-0", "epd-pd-0", "epd-pd-1")}
    s = Stack.start(ckpt, tmp_path_factory.mktemp(f"vllm-{request.param}"), n_ve=1, n_pd=2, sim_env=env)
    served: list[str] = []
    yield s, served
    s.stop()


@pytest.fixture
def stack(engines, request) -> Stack:
    """The release's stack as a fresh one: after an earlier test, its PDs' faults off and a router
    of this test's own (its counters and its log start empty)."""
    s, served = engines
    if served:
        _faults(s)
        s.router.stop()
        s.router = RouterProc(s.router.config_path, s.workdir / f"router-{len(served)}.log", s.router.port).start()
    served.append(request.node.name)
    return s


def _faults(stack: Stack, **faults: object) -> None:
    for pd in stack.pds:
        r = httpx.put(pd.url + "/sim/faults", json=faults, timeout=5)
        assert r.status_code == 200, r.text


def _body(i: int, stream: bool) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"request {i}: say something"}],
        "max_tokens": 8,
        "stream": stream,
    }


def _no_internals(stack: Stack, text: str) -> None:
    leaked = [internal for internal in stack.internals() if internal in text]
    assert not leaked, f"engine internals {leaked} in {text[:300]!r}"


def _pds_uncharged(stack: Stack) -> None:
    pools = stack.router.pools()
    for pd in stack.pds:
        assert pools[pd.engine_id]["healthy"] and pools[pd.engine_id]["failures"] == 0, pools[pd.engine_id]


def test_generation_errors_reach_the_client_and_eject_no_pd(stack: Stack):
    url = stack.router.url + "/v1/chat/completions"
    # before any token (a KV load failure's place): non-streaming and streaming answers are JSON
    _faults(stack, generation_error_rate=1.0)
    for i in range(FAILING):
        r = httpx.post(url, json=_body(i, stream=bool(i % 2)), timeout=30)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["message"]) == ("upstream_error", 502, CLIENT_MESSAGE)
        _no_internals(stack, r.text)
    _pds_uncharged(stack)

    # mid-stream: the tokens before it, then the router's error frame (no [DONE])
    _faults(stack, generation_error_rate=1.0, generation_error_after=3)
    for i in range(FAILING):
        with httpx.stream("POST", url, json=_body(100 + i, stream=True), timeout=30) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert "[DONE]" not in events, raw
        docs = [json.loads(e) for e in events]
        assert docs[-1]["error"]["message"] == CLIENT_MESSAGE and docs[-1]["error"]["code"] == 502
        assert any(c["delta"].get("role") for d in docs[:-1] for c in d["choices"])  # it had started
        _no_internals(stack, raw)
    # non-streaming, after some tokens: 0.24 answers 200 with the failed choice, 0.29 its 500
    for i in range(FAILING):
        r = httpx.post(url, json=_body(200 + i, stream=False), timeout=30)
        assert r.status_code == 502 and r.json()["error"]["message"] == CLIENT_MESSAGE, r.text
    _pds_uncharged(stack)

    _faults(stack)
    for stream in (False, True):
        assert httpx.post(url, json=_body(300, stream), timeout=30).status_code == 200
    log = stack.router.log()
    assert "vLLM generation error" in log and "not counted against the engine" in log


def test_an_engine_wide_500_still_ejects_its_pd(stack: Stack):
    """The sim's `error_rate` 500 ("simulated internal error", not vLLM's GenerationError body)
    is an engine failure: it is charged and ejects its PD (its `/health`, still 200, readmits
    it at the next probe), the other PD serves the requests."""
    bad, good = stack.pds
    r = httpx.put(bad.url + "/sim/faults", json={"error_rate": 1.0}, timeout=5)
    assert r.status_code == 200, r.text
    url = stack.router.url + "/v1/chat/completions"
    for i in range(6):
        assert httpx.post(url, json=_body(400 + i, stream=bool(i % 2)), timeout=30).status_code == 200
    pools = stack.router.pools()
    assert pools[bad.engine_id]["failures"] >= 2 and pools[good.engine_id]["failures"] == 0, pools
    ejected = [json.loads(line) for line in stack.router.log().splitlines() if '"engine ejected"' in line]
    assert [e["engine"] for e in ejected] and {e["engine"] for e in ejected} == {bad.engine_id}, ejected
