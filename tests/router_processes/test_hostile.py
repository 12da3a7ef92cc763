"""Hostile input and slow clients against a real router (+ sims) on 127.0.0.1: a selection
of bench/hostile.py's cases (surrogates, deep nesting, huge flat bodies, broken JSON, bad
images, malformed HTTP) never gets a 500 and always a JSON envelope with a request id, while
/health stays responsive; slow clients (bench/slowloris.py, fewer connections) are closed
within the listener's timeouts; the connection cap answers 503; a client that leaves during
its upload is a quiet 499. The full runs and their figures: docs/router.md."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import hostile, slowloris

from .harness import HOST, Stack, wait_until

LISTEN = {"header_timeout_s": 1.0, "body_timeout_s": 2.0, "idle_timeout_s": 5.0, "max_connections": 150}


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    s = Stack.start(ckpt, tmp_path_factory.mktemp("hostile"), n_ve=1, n_pd=1, listen=LISTEN)
    yield s
    s.stop()


def counter(stack: Stack, name: str, **labels: str) -> float:
    """The sum of `name`'s series that carry `labels` (whatever else they carry: the model label)."""
    text = httpx.get(stack.router.url + "/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def test_hostile_inputs_never_get_a_500_and_health_stays_responsive(stack):
    selected = hostile.cases(random_count=15, big=False)
    summary = hostile.run(stack.router.url, selected, concurrency=6, max_s=120)
    assert summary["answers_500"] == 0, summary["statuses"]
    assert summary["problems"] == []
    assert summary["statuses"].get("200", 0) >= sum(c.valid for c in selected)
    # the bench's requirement is p99 < 100 ms (docs/router.md). Here, at nice 5 beside two e2e
    # lanes, p99 of 45 samples is their maximum, and one scheduling stall reached 373 ms in a CI
    # run: the typical probe must stay fast, and no probe may wait behind hostile work for a
    # second (what a blocked event loop would show)
    health = summary["operations"]["/health"]
    assert health["p50_ms"] < 100 and health["max_ms"] < 1000, summary["operations"]
    assert summary["probe_failures"] == 0
    log = stack.router.log()
    assert "Traceback" not in log and "internal error" not in log


def test_a_keep_alive_connection_survives_a_refused_request(stack):
    """A 4xx leaves the connection usable (a 500 used to make uvicorn close it)."""
    with httpx.Client(base_url=stack.router.url, timeout=10) as client:
        bad = client.post("/v1/chat/completions", content='{"messages":[{"role":"user","content":"\\ud800"}]}')
        assert bad.status_code == 400 and bad.json()["request_id"]
        good = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        assert good.status_code == 200
        assert len(client._transport._pool.connections) == 1  # the same connection served both


def test_slow_clients_are_closed_within_the_timeouts(stack):
    before = {
        r: counter(stack, "epd_router_client_connections_closed_total", reason=r)
        for r in ("header_timeout", "body_timeout")
    }
    result = slowloris.run(stack.router.url, 40, LISTEN["header_timeout_s"], LISTEN["body_timeout_s"], slack_s=1.5)
    assert result["all_closed_within_timeout"], result["kinds"]
    assert result["kinds"]["trickled head"]["answered_408"] == 10
    assert result["probe_failures"] == 0
    after = {r: counter(stack, "epd_router_client_connections_closed_total", reason=r) for r in before}
    assert after["header_timeout"] - before["header_timeout"] >= 20
    assert after["body_timeout"] - before["body_timeout"] >= 20


def test_connections_over_the_cap_get_a_503(stack):
    socks = []
    try:
        for _ in range(LISTEN["max_connections"] + 10):
            socks.append(socket.create_connection((HOST, stack.router.port), timeout=5))
        refused = 0
        for sock in socks[-10:]:
            data = sock.recv(4096)
            refused += data.startswith(b"HTTP/1.1 503") and b"listen.max_connections" in data
        assert refused >= 5  # the probe and other clients may hold a few of the slots
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: httpx.get(stack.router.url + "/health", timeout=2).status_code == 200, 10, "router serves")


def test_a_client_that_leaves_during_its_upload_is_a_quiet_499(stack):
    before = counter(stack, "epd_router_requests_total", status="client_closed")
    with socket.create_connection((HOST, stack.router.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n" + b'{"messages": "' + b"x" * 100_000
        )
        time.sleep(0.2)
    wait_until(
        lambda: counter(stack, "epd_router_requests_total", status="client_closed") > before,
        5,
        "the request counted as client_closed",
    )
    log = stack.router.log()
    assert "client left during upload" in log
    assert "Traceback" not in log and "internal error" not in log


def test_one_clients_attacks_do_not_deny_service_to_the_others(stack):
    """Attacks of one client on the others (bench/hostile.py `attacks`, shorter and smaller): while
    64 uploads trickle their bodies, two clients send 999-frame GIFs, or six 8 MB bodies
    arrive, legitimate text and image requests are all answered, quickly, and /health stays
    responsive. (Before: 64 slow uploads made every other request a 429 for body_timeout_s;
    a 999-frame GIF held an image thread for minutes.)"""
    results = hostile.attacks(stack.router.url, big=False, seconds=3.0)
    for name, got in results.items():
        for kind in ("text", "image"):
            assert got[kind]["n"] >= 1 and got[kind]["not_200"] == 0, (name, got)
            # the bench's goal is p99 < 2 s (docs/router.md); a shared CI machine gets slack
            assert got[kind]["p99_s"] < 4.0, (name, got)
        assert got["/health"]["p99_ms"] < 300 and got["probe_failures"] == 0, (name, got)
    log = stack.router.log()
    assert "Traceback" not in log and "internal error" not in log


@pytest.mark.parametrize("token", ["<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>"])
def test_a_special_token_in_message_text_is_a_400_naming_it(stack, token):
    """Issue 58: only `<|image_pad|>` was refused; the others reached the PD."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"see {token} here"}], "max_tokens": 2}
    answer = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert token in error["message"] and error["param"] == "messages[0].content"


def test_output_tokens_over_the_context_are_refused_as_vllm_refuses_them(stack):
    """Issue 58: `max_tokens` 100000 on an 8192-token model was a 200 cut at the context; vLLM's
    chat route answers 400 (router/context_window.py). The context is the PD's own /v1/models."""
    context = httpx.get(stack.pds[0].url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"]

    def ask(**fields) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], **fields}
        return httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=30)

    answer = ask(max_tokens=100000)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "BadRequestError"
    assert error["message"] == (
        f"max_tokens=100000 cannot be greater than max_model_len=max_total_tokens={context}. "
        "Please request fewer output tokens. (parameter=max_tokens, value=100000)"
    )
    # the prompt and the output together: the count vLLM's tokenizer stops at, "at least"
    answer = ask(max_completion_tokens=context - 2)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "input_tokens"
    assert error["message"].startswith(
        f"This model's maximum context length is {context} tokens. However, you requested {context - 2} "
        "output tokens and your prompt contains at least 3 input tokens, for a total of at least "
        f"{context + 1} tokens."
    )
    assert ask(max_tokens=2).status_code == 200  # within the context: served
