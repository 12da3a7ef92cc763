"""A tenant is charged what the engines did for a request its client abandons (issue 58 item 1),
against a real router and sim engines on 127.0.0.1 whose PD takes real time (a prefill of
~1.5 s, 20 ms a token), with real HTTP clients that leave: a non-streaming request left during
the prefill and during the decode (charged the PD's whole answer: the call runs on), a stream
left before its first token (its prompt) and after some tokens (its prompt and the tokens the
router got). The PD's own counters say what it did. Every wait is bounded."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from .harness import Stack, wait_until

KEY = "sk-charged-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 60
PROMPT = "tell me everything " * 25  # ~330 tokens: a prefill of ~1.6 s at 5 s per 1k tokens


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("charging")
    tenants = tmp / "tenants"
    tenants.write_text(f"tenant t tokens_per_min=100000000\nkey t {KEY}\n")
    tenants.chmod(0o640)
    slow = {"EPD_SIM_PREFILL_MS_PER_1K_TOKENS": "5000", "EPD_SIM_DECODE_MS_PER_TOKEN": "20"}
    s = Stack.start(ckpt, tmp, n_ve=1, n_pd=1, sim_env={"epd-pd-0": slow}, auth={"tenants_file": str(tenants)})
    yield s
    s.stop()


def body(stream: bool) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


def charged(stack: Stack) -> float:
    text = httpx.get(stack.router.url + "/metrics", headers=AUTH, timeout=5, trust_env=False).text
    found = re.search(r'^epd_router_tenant_tokens_total\{tenant="t"\} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def pd_tokens(stack: Stack) -> tuple[float, float, float]:
    """The PD's prompt and generated tokens and its aborted requests, from its own /metrics."""
    text = httpx.get(stack.pds[0].url + "/metrics", timeout=5, trust_env=False).text

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern + r"[^\n]* ([0-9.e+]+)$", text, re.M))

    return (
        total(r"^vllm:prompt_tokens_total"),
        total(r"^vllm:generation_tokens_total"),
        total(r'^vllm:request_success_total\{[^}]*finished_reason="abort"'),
    )


def pd_inflight(stack: Stack) -> int:
    doc = httpx.get(stack.router.url + "/pools", headers=AUTH, timeout=5, trust_env=False).json()
    return next(e["inflight"] for e in doc["engines"] if e["id"] == "epd-pd-0")


@pytest.fixture(scope="module")
def prompt_tokens(stack) -> int:
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=body(False), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    wait_until(lambda: charged(stack) > 0, 10, "the full answer charged")
    return usage["prompt_tokens"]


def settled(stack: Stack, before: float, what: str) -> float:
    """What the request was charged, once the charge stops moving (the PD has ended it)."""
    wait_until(lambda: charged(stack) > before, 15, f"{what}: a charge")
    last = charged(stack)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the engines finish within a few seconds; then no change
        time.sleep(0.5)
        now = charged(stack)
        if now == last and pd_inflight(stack) == 0:
            return now - before
        last = now
    raise AssertionError(f"{what}: the charge never settled")


@pytest.mark.parametrize("leave_after_s", [0.5, 2.0], ids=["during-prefill", "during-decode"])
def test_a_non_streaming_request_left_is_charged_the_pds_whole_answer(stack, prompt_tokens, leave_after_s):
    before, (pd_prompt, pd_generated, _) = charged(stack), pd_tokens(stack)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(stack.router.url + "/v1/chat/completions", json=body(False), headers=AUTH, timeout=leave_after_s)
    cost = settled(stack, before, "a non-streaming request left")
    done_prompt, done_generated, _ = pd_tokens(stack)
    # the PD generated the whole answer (the router did not abort it), and exactly that is charged
    assert done_generated - pd_generated == MAX_TOKENS
    assert cost == prompt_tokens + MAX_TOKENS == (done_prompt - pd_prompt) + (done_generated - pd_generated)


def test_a_stream_left_before_its_first_token_is_charged_its_prompt(stack, prompt_tokens):
    before, (_, pd_generated, aborted) = charged(stack), pd_tokens(stack)
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=0.5), trust_env=False) as client,
        pytest.raises(httpx.ReadTimeout),  # the router answers once the PD's first event came: ~1.5 s
        client.stream("POST", stack.router.url + "/v1/chat/completions", json=body(True), headers=AUTH) as r,
    ):
        r.read()
    cost = settled(stack, before, "a stream left before its first token")
    wait_until(lambda: pd_tokens(stack)[2] > aborted, 10, "the PD aborted the stream")
    # used to be charged nothing; the PD aborted it before generating (at most a token or two)
    assert cost == prompt_tokens
    assert pd_tokens(stack)[1] - pd_generated <= 2


def test_a_stream_left_after_some_tokens_is_charged_its_prompt_and_the_tokens_got(stack, prompt_tokens):
    before, (_, pd_generated, aborted) = charged(stack), pd_tokens(stack)
    seen = 0
    with (
        httpx.Client(timeout=30, trust_env=False) as client,
        client.stream("POST", stack.router.url + "/v1/chat/completions", json=body(True), headers=AUTH) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                seen += 1
            if seen >= 10:
                break  # the client leaves after ten tokens of sixty
    cost = settled(stack, before, "a stream left after some tokens")
    wait_until(lambda: pd_tokens(stack)[2] > aborted, 10, "the PD aborted the stream")
    generated = pd_tokens(stack)[1] - pd_generated
    assert generated < MAX_TOKENS  # the router aborted the PD: it did not generate the rest
    assert prompt_tokens + seen <= cost <= prompt_tokens + generated
