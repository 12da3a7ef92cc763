"""Tenants against a real router and sim engines on 127.0.0.1: a tenant over its token quota
gets a 429 in OpenAI's shape with a Retry-After computed from its bucket, and honouring it
succeeds, while another tenant's requests (the official openai client) keep succeeding; the
per-tenant metrics count both; a rotation of the tenants file (SIGHUP) takes a new key
without a restart. Every loop is bounded in count and time."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from .harness import Stack, wait_until

TOKENS_PER_MIN = 1200  # 20 a second: a few answers of ~150 tokens exhaust it
MAX_TOKENS = 120
NOISY, CALM = "sk-noisy-0123456789", "sk-calm-0123456789"


def tenants_file(path, extra: str = "") -> None:
    path.write_text(
        f"tenant noisy tokens_per_min={TOKENS_PER_MIN} requests_per_s=50\n"
        "tenant calm concurrent_requests=4\n"
        f"key noisy {NOISY}\nkey calm {CALM}\n{extra}"
    )
    path.chmod(0o640)


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    """One stack for both tests (~2 CPU-s to start): the quota test ends with the noisy tenant's
    debt honoured, the rotation test uses keys of its own and leaves the running keys as they were."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    tenants = tmp_path / "tenants"
    tenants_file(tenants)
    s = Stack.start(ckpt, tmp_path, n_ve=1, n_pd=1, auth={"tenants_file": str(tenants)})
    s.tenants_path = tenants  # type: ignore[attr-defined]
    yield s
    s.stop()


def ask(url: str, key: str) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    return httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False
    )


def test_a_tenant_over_its_token_quota_waits_its_retry_after_while_another_is_served(stack):
    url = stack.router.url
    calm = openai.OpenAI(base_url=url + "/v1", api_key=CALM, max_retries=0, timeout=30)
    served_calm = 0
    refusal = None
    for _ in range(40):  # ~150 tokens each: the quota of 1200 is gone after about 8
        r = ask(url, NOISY)
        if r.status_code == 429:
            refusal = r
            break
        assert r.status_code == 200, r.text
        reply = calm.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )  # the other tenant, meanwhile
        served_calm += reply.choices[0].finish_reason is not None
    assert refusal is not None, "the noisy tenant was never refused"
    doc = refusal.json()
    assert doc["error"]["type"] == "rate_limit_error" and doc["error"]["code"] == 429
    assert f"tenant 'noisy' is over its limit of {TOKENS_PER_MIN} tokens per minute" in doc["error"]["message"]
    assert doc["request_id"] == refusal.headers["x-request-id"]
    retry_after = int(refusal.headers["Retry-After"])
    # at most one answer's worth of debt, refilled at 20 a second (+1 s rounding)
    assert 1 <= retry_after <= (MAX_TOKENS + 40) / (TOKENS_PER_MIN / 60) + 1, retry_after
    assert served_calm >= 5
    # the other tenant is not held up by the noisy one's refusal
    assert calm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    time.sleep(retry_after)
    assert ask(url, NOISY).status_code == 200  # honoured: it succeeds

    auth = {"Authorization": f"Bearer {CALM}"}  # auth.protect_metrics: any valid key
    metrics = httpx.get(url + "/metrics", headers=auth, timeout=5, trust_env=False).text
    assert 'epd_router_tenant_requests_total{result="refused",tenant="noisy"} 1.0' in metrics
    assert 'epd_router_tenant_limit{limit="tokens_per_min",tenant="noisy"} 1200.0' in metrics
    assert "sk-noisy" not in stack.router.log() and "sk-calm" not in stack.router.log()


def test_a_rotated_tenants_file_takes_effect_on_reload(stack):
    url = stack.router.url
    assert ask(url, "sk-new-key-000").status_code == 401
    tenants_file(stack.tenants_path, "key calm sk-new-key-000\n")
    stack.router.reload()
    wait_until(lambda: ask(url, "sk-new-key-000").status_code == 200, 10, "the new key accepted")
    tenants_file(stack.tenants_path, "key clam sk-typo-000\n")  # a typo: refused, the running keys stay
    stack.router.reload()
    wait_until(lambda: "line 5: tenant 'clam' is not defined" in stack.router.log(), 10, "the typo logged")
    assert ask(url, "sk-new-key-000").status_code == 200
