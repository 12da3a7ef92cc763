"""Fault tolerance, reload and shutdown, with real engine processes killed and restarted.

Every load loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message

from .harness import SimEngine, Stack, wait_until

SLOW_PD = {"EPD_SIM_DECODE_MS_PER_TOKEN": "8"}


@pytest.fixture
def make_stack(ckpt, tmp_path):
    stacks: list[Stack] = []

    def make(n_ve, n_pd, sim_env=None, **cfg):
        s = Stack.start(ckpt, tmp_path, n_ve=n_ve, n_pd=n_pd, sim_env=sim_env, **cfg)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.stop()


@dataclass
class Outcome:
    index: int
    kind: str  # "ok" | "error_frame" | "failed"
    detail: str = ""
    started_at: float = 0.0


def case(i: int, n_images: int = 1) -> list[dict]:
    parts = [f"Request {i}: describe."] + [
        image_part(png_data_url(256, 256, seed=1000 + i * 7 + k)) for k in range(n_images)
    ]
    return [user_message(*parts)]


def run_one(stack: Stack, expected, i: int, stream: bool, max_tokens: int) -> Outcome:
    messages, tokens, text = expected
    t0 = time.monotonic()
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
    try:
        if not stream:
            c = openai.OpenAI(base_url=stack.router.url + "/v1", api_key="x", max_retries=0, timeout=30)
            resp = c.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
            if resp.choices[0].token_ids != tokens:
                return Outcome(i, "failed", "wrong tokens", t0)
            return Outcome(i, "ok", "", t0)
        with httpx.stream(
            "POST", stack.router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as r:
            if r.status_code != 200:
                return Outcome(i, "failed", f"HTTP {r.status_code}: {r.read()[:300]!r}", t0)
            raw = r.read().decode()
        events = [e[len("data: ") :] for e in raw.split("\n\n") if e]
        docs = [json.loads(e) for e in events if e != "[DONE]"]
        if events[-1] != "[DONE]" and "error" not in docs[-1]:  # an error frame ends a stream
            return Outcome(i, "failed", f"stream ended with neither [DONE] nor an error: {raw[-200:]!r}", t0)
        if any("error" in d for d in docs):
            err_at = next(k for k, d in enumerate(docs) if "error" in d)
            if err_at != len(docs) - 1 or not docs[err_at]["error"]["message"] or err_at == 0:
                return Outcome(i, "failed", f"bad error framing: {raw[-300:]!r}", t0)
            if leaked := _internals_in(stack, raw[-500:]):
                return Outcome(i, "failed", f"engine internals {leaked} in the error frame: {raw[-300:]!r}", t0)
            return Outcome(i, "error_frame", docs[err_at]["error"]["message"], t0)
        got = "".join(c["delta"].get("content", "") for d in docs for c in d["choices"])
        return Outcome(i, "ok" if got == text else "failed", "" if got == text else "wrong text", t0)
    except Exception as exc:
        leaked = _internals_in(stack, str(exc))  # an openai error quotes the router's JSON body
        return Outcome(
            i, "failed", f"{type(exc).__name__}: {exc}" + (f" (engine internals {leaked})" * bool(leaked)), t0
        )


def _internals_in(stack: Stack, text: str) -> list[str]:
    """The engine addresses and ids in an error a client got: none."""
    return [internal for internal in stack.internals() if internal in text]


def expectations(oracle, n, max_tokens, offset=0):
    out = []
    for i in range(offset, offset + n):
        messages = case(i, 1 + i % 2)
        _, tokens, _, text = oracle.expect(messages, max_tokens)
        out.append((messages, tokens, text))
    return out


def run_load(stack, oracle, n, workers, stream_every=0, max_tokens=24, during=None, when=None, offset=0):
    """n requests from `workers` threads; `during()` runs once, as soon as `when()` holds
    (bounded wait), while the load is running."""
    results: list[Outcome] = []
    expected = expectations(oracle, n, max_tokens, offset)  # before the clock starts
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [
            pool.submit(run_one, stack, expected[i], i, bool(stream_every) and i % stream_every == 0, max_tokens)
            for i in range(n)
        ]
        event_at = None
        if during is not None:
            wait_until(
                lambda: (when or (lambda: True))() or all(f.done() for f in futures),
                30,
                "the moment to inject the fault",
            )
            assert not all(f.done() for f in futures), "the load finished before the fault"
            event_at = time.monotonic()
            during()
        for f in futures:
            results.append(f.result(timeout=120))
    return results, event_at


def test_kill_a_pd_under_load(make_stack, oracle):
    # epd-pd-0 (the one killed) decodes at 100 ms a token, 4 s a request, so polling /pools sees a
    # request in flight there: at 8 ms a token (0.3 s a request) the whole load once finished
    # between two polls (a loaded run beside CPU burners, load ~20, the lane at nice 5)
    sim_env = {"epd-pd-0": {"EPD_SIM_DECODE_MS_PER_TOKEN": "100"}} | {f"epd-pd-{i}": SLOW_PD for i in (1, 2)}
    stack = make_stack(2, 3, sim_env=sim_env)
    router = stack.router
    results, killed_at = run_load(
        stack,
        oracle,
        n=24,
        workers=6,
        stream_every=2,
        max_tokens=40,
        during=stack.pds[0].kill,
        when=lambda: router.pools()["epd-pd-0"]["inflight"] >= 1,
    )
    failed = [r for r in results if r.kind == "failed"]
    assert not failed, failed
    # non-streaming requests are always retryable before the first byte: all succeeded
    assert all(r.kind == "ok" for r in results if r.index % 2 == 1)
    after = [r for r in results if r.started_at > killed_at]
    assert after and all(r.kind == "ok" for r in after)
    pools = stack.router.pools()
    assert pools["epd-pd-0"]["healthy"] is False and pools["epd-pd-0"]["failures"] >= 1
    assert pools["epd-pd-0"]["inflight"] == 0

    # a stream that already started when its PD dies ends with one error frame
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "long story"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"role":"assistant"' in first
        busy = [e for e, p in router.pools().items() if p["role"] == "pd" and p["inflight"] == 1]
        assert len(busy) == 1
        next(pd for pd in stack.pds if pd.engine_id == busy[0]).kill()
        events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    error = json.loads(events[-1])  # the router's own frame, nothing after it
    assert error["error"]["code"] == 502 and error["error"]["message"] == "the connection to the engine broke"
    assert error["request_id"] and not _internals_in(stack, events[-1])
    assert "[DONE]" not in events and all("error" not in json.loads(e) for e in events[:-1])


def test_kill_a_ve_under_load(make_stack, oracle):
    # epd-ve-1 (the one killed) encodes for 1 s, so polling /pools sees a request in flight there
    # however loaded the machine is: at 100 ms on every VE, the 20 requests all finished between
    # two polls once (a CI run at nice 5 beside two e2e lanes); the others take 100 ms
    latency_ms = {"epd-ve-0": "100", "epd-ve-1": "1000", "epd-ve-2": "100"}
    stack = make_stack(3, 3, sim_env={ve: {"EPD_SIM_EXTRA_LATENCY_MS": ms} for ve, ms in latency_ms.items()})
    router = stack.router
    results, _ = run_load(
        stack,
        oracle,
        n=20,
        workers=6,
        during=stack.ves[1].kill,
        when=lambda: router.pools()["epd-ve-1"]["inflight"] >= 1,
    )
    failed = [r for r in results if r.kind != "ok"]
    assert not failed, failed
    pools = stack.router.pools()
    assert pools["epd-ve-1"]["healthy"] is False
    # and the pool keeps serving new images
    more, _ = run_load(stack, oracle, n=6, workers=3, offset=100)
    assert all(r.kind == "ok" for r in more)


def test_a_ve_drained_as_a_rollout_drains_it_stops_only_after_the_pd_read_its_blocks(make_stack, oracle):
    """The rollout's drain, step by step: reload with the VE draining, wait until /pools shows it
    draining with 0 in flight, stop it. The PD reads the VE's blocks after the encode returned
    (3 s later here), and a VE stopped in between kills the PD's engine core (ECLoadFailure):
    the VE's count lasted only while it encoded, so the drain ended at once and the PD died."""
    stack = make_stack(1, 1, sim_env={"epd-pd-0": {"EPD_SIM_EXTRA_LATENCY_MS": "3000"}})
    router, (ve,), (pd,) = stack.router, stack.ves, stack.pds
    outcome: dict = {}

    def one_request():
        outcome["results"], _ = run_load(stack, oracle, n=1, workers=1)

    client = threading.Thread(target=one_request)
    client.start()
    wait_until(lambda: router.pools()["epd-pd-0"]["inflight"] == 1, 20, "the request on the PD (its encode done)")
    cfg = json.loads(json.dumps(stack.config))
    cfg["endpoints"]["ve"][0]["state"] = "draining"
    router.write_config(cfg)
    router.reload()
    drained: dict = {}

    def ve_drained() -> bool:
        drained.update(router.pools())
        return drained["epd-ve-0"]["state"] == "draining" and drained["epd-ve-0"]["inflight"] == 0

    wait_until(ve_drained, 30, "the VE drained")
    ve.stop()  # what the rollout does next: restart it
    client.join(timeout=60)
    assert not client.is_alive()
    assert [r.kind for r in outcome["results"]] == ["ok"], outcome["results"]
    # the same /pools answer that ended the drain: the request had left the PD too
    assert drained["epd-pd-0"]["inflight"] == 0, "the drain ended while the PD had not read the VE's blocks"
    assert pd.proc is not None and pd.proc.poll() is None, "the PD engine died"


def test_drain_by_config_reload_under_load(make_stack, oracle):
    stack = make_stack(2, 2, sim_env={f"epd-pd-{i}": SLOW_PD for i in range(2)})
    router = stack.router
    outcome: dict = {}

    def load():
        outcome["results"], _ = run_load(stack, oracle, n=28, workers=4, stream_every=3, max_tokens=30)

    loader = threading.Thread(target=load)
    loader.start()
    wait_until(lambda: router.pools()["epd-pd-0"]["inflight"] >= 1, 20, "load on pd-0")
    cfg = json.loads(json.dumps(stack.config))
    cfg["endpoints"]["ve"][0]["state"] = "draining"
    cfg["endpoints"]["pd"][0]["state"] = "draining"
    router.write_config(cfg)
    router.reload()
    wait_until(lambda: router.pools()["epd-pd-0"]["state"] == "draining", 5, "reload applied")
    wait_until(
        lambda: all(router.pools()[e]["inflight"] == 0 for e in ("epd-pd-0", "epd-ve-0")),
        10,
        "drained engines reach 0 in flight",
    )
    served = {e: router.pools()[e]["served"] for e in ("epd-pd-0", "epd-ve-0")}
    loader.join(timeout=120)
    assert not loader.is_alive()
    assert [r for r in outcome["results"] if r.kind != "ok"] == []
    pools = router.pools()
    assert {e: pools[e]["served"] for e in served} == served  # no new work after draining
    assert pools["epd-pd-1"]["served"] > 0 and pools["epd-ve-1"]["served"] > 0
    assert httpx.get(router.url + "/ready").status_code == 200

    # a broken file on reload keeps the running config
    router.config_path.write_text("endpoints: [unclosed\n")
    router.reload()
    wait_until(lambda: "config reload failed" in router.log(), 5, "reload error logged")
    assert "not valid YAML" in router.log()
    assert router.pools()["epd-pd-0"]["state"] == "draining"
    more, _ = run_load(stack, oracle, n=4, workers=2)
    assert all(r.kind == "ok" for r in more)

    # removing an endpoint and reactivating another applies atomically
    cfg["endpoints"]["pd"] = [cfg["endpoints"]["pd"][1]]
    cfg["endpoints"]["ve"][0]["state"] = "active"
    router.write_config(cfg)
    router.reload()
    wait_until(lambda: "epd-pd-0" not in router.pools(), 5, "pd-0 removed")
    assert router.pools()["epd-ve-0"]["state"] == "active"
    more, _ = run_load(stack, oracle, n=4, workers=2)
    assert all(r.kind == "ok" for r in more)


def test_all_pds_down_gives_503_then_recovers(make_stack, oracle):
    stack = make_stack(1, 2)
    router = stack.router
    for pd in stack.pds:
        pd.stop()
    wait_until(lambda: httpx.get(router.url + "/ready").status_code == 503, 10, "/ready 503")
    ready = httpx.get(router.url + "/ready")
    assert "no healthy active PD" in ready.json()["reason"] and ready.headers["retry-after"]
    body = {"model": "m", "messages": case(1), "max_tokens": 8}
    for stream in (False, True):
        r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 503 and "no healthy active PD" in err["message"]
        assert r.json()["request_id"] and not _internals_in(stack, r.text)
    assert httpx.get(router.url + "/healthcheck").json()["pd_healthy"] == 0

    restarted = [SimEngine("pd", pd.engine_id, pd.ckpt, pd.log_dir, port=pd.port).start() for pd in stack.pds]
    stack.pds = restarted
    for pd in restarted:
        pd.wait_healthy()
    wait_until(lambda: httpx.get(router.url + "/ready").status_code == 200, 10, "/ready 200 again")
    results, _ = run_load(stack, oracle, n=4, workers=2, stream_every=2)
    assert all(r.kind == "ok" for r in results), results


def test_client_disconnect_cancels_the_pd_request(make_stack):
    stack = make_stack(1, 1, sim_env={"epd-pd-0": {"EPD_SIM_DECODE_MS_PER_TOKEN": "20"}})
    router, pd = stack.router, stack.pds[0]

    def aborted() -> float:
        text = httpx.get(pd.url + "/metrics").text
        m = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.]+)', text)
        return float(m.group(1)) if m else 0.0

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: aborted() >= 1, 5, "PD aborted the streaming request")
    wait_until(lambda: router.pools()["epd-pd-0"]["inflight"] == 0, 5, "PD slot released")

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    wait_until(lambda: aborted() >= 2, 5, "PD aborted the non-streaming request")
    wait_until(lambda: router.pools()["epd-pd-0"]["inflight"] == 0, 5, "PD slot released")


def test_sigterm_drains_in_flight_then_exits(make_stack, oracle):
    messages = case(5)
    _, tokens, _, text = oracle.expect(messages, 60)
    # the stream lasts 6 s whatever its length: it outlasts the checks below on a starved machine
    per_token_ms = math.ceil(6000 / len(tokens))
    stack = make_stack(1, 1, sim_env={"epd-pd-0": {"EPD_SIM_DECODE_MS_PER_TOKEN": str(per_token_ms)}})
    router = stack.router
    got: dict = {}
    first = threading.Event()

    def stream():
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        parts = []
        for chunk in c.chat.completions.create(model="m", messages=messages, max_tokens=60, stream=True):
            first.set()
            parts.extend(ch.delta.content or "" for ch in chunk.choices)
        got["text"] = "".join(parts)

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(10)
    router.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(router.url + "/ready").status_code == 503, 5, "/ready flips to 503")
    assert httpx.get(router.url + "/ready").json()["reason"] == "router is shutting down"
    t.join(timeout=30)
    assert got.get("text") == text  # the in-flight stream finished intact
    assert router.proc.wait(timeout=15) == 0
