"""End-to-end: the official `openai` client → epd-router → epd-sim VEs and PDs (loopback).

The sim's output tokens are a pure function of the prompt ids and of the embedding bytes the
PD actually read from the VEs, so equality with the oracle proves every image reached the
right request intact (and in the right order)."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_kit.testing.images import image_part, png_data_url, user_message

MAX_TOKENS = 24


def client(stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.router.url + "/v1", api_key="unused", max_retries=0, timeout=30, **kw)


def check_completion(resp, oracle, messages, max_tokens=MAX_TOKENS):
    rendered, tokens, finish, text = oracle.expect(messages, max_tokens)
    choice = resp.choices[0]
    assert choice.token_ids == tokens  # vLLM extension field, kept by the client as extra
    assert choice.message.content == text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == finish
    assert resp.usage.prompt_tokens == len(rendered.token_ids)
    assert resp.usage.completion_tokens == len(tokens)
    assert resp.usage.total_tokens == len(rendered.token_ids) + len(tokens)
    return rendered


def test_text_only(stack, oracle):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
    ]
    resp = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
    check_completion(resp, oracle, messages)
    assert resp.object == "chat.completion" and resp.model == "tiny"


def test_one_image(stack, oracle):
    messages = [user_message("Describe this image.", image_part(png_data_url(320, 200, seed=1)))]
    resp = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
    rendered = check_completion(resp, oracle, messages)
    assert len(rendered.items) == 1


def test_many_images_with_duplicates_in_prompt_order(stack, oracle):
    urls = [png_data_url(256 + 32 * i, 256, seed=10 + i) for i in range(4)]
    parts = ["Compare these images."] + [image_part(urls[i]) for i in (0, 1, 2, 0, 3, 1)]
    messages = [user_message(*parts)]
    before = httpx.get(stack.router.url + "/metrics").text
    resp = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
    rendered = check_completion(resp, oracle, messages)
    assert len(rendered.items) == 6 and len({i.mm_hash for i in rendered.items}) == 4
    after = httpx.get(stack.router.url + "/metrics").text
    assert metric(after, "epd_router_dedupe_items_total") - metric(before, "epd_router_dedupe_items_total") == 2
    assert metric(after, "epd_router_encode_items_total") - metric(before, "epd_router_encode_items_total") == 4
    # the same images in another order give another (still correct) answer
    swapped = [user_message(*(parts[:1] + parts[1:][::-1]))]
    resp2 = client(stack).chat.completions.create(model="tiny", messages=swapped, max_tokens=MAX_TOKENS)
    check_completion(resp2, oracle, swapped)
    assert resp2.choices[0].token_ids != resp.choices[0].token_ids


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{[^}]*\})?") + r" ([0-9.e+-]+)"
    return sum(float(m.group(m.lastindex)) for m in re.finditer(pattern, text))


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_streaming_text_and_usage_semantics(stack, oracle, include_usage):
    messages = [user_message("Describe this image in one sentence.", image_part(png_data_url(300, 260, seed=3)))]
    kwargs = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    stream = client(stack).chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, stream=True, **kwargs
    )
    chunks = list(stream)
    rendered, tokens, finish, text = oracle.expect(messages, MAX_TOKENS)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content_chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == text
    assert content_chunks[-1].choices[0].finish_reason == finish
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    usage_chunks = [c for c in chunks if not c.choices]
    if include_usage:
        assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
        assert usage_chunks[0].usage.prompt_tokens == len(rendered.token_ids)
        assert usage_chunks[0].usage.completion_tokens == len(tokens)
    else:  # OpenAI semantics: no usage chunk unless asked (the reference router differs)
        assert usage_chunks == []


def test_streaming_detokenization_matches_full_decode(stack, oracle):
    """Byte-level BPE tokens split multi-byte characters; deltas must never show U+FFFD
    halves and must add up to the full decode, for several long answers."""
    for seed in range(4):
        messages = [{"role": "user", "content": f"你好，世界。Grüße {seed} — café naïve"}]
        stream = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=96, stream=True)
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        _, _, _, text = oracle.expect(messages, 96)
        assert "".join(deltas) == text
        assert not any(d.endswith("\ufffd") for d in deltas if "\ufffd" not in text)


def test_request_id_is_accepted_and_echoed(stack):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=body, headers={"x-request-id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123"
    with httpx.stream(
        "POST",
        stack.router.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": "s-1"},
    ) as s:
        assert s.headers["x-request-id"] == "s-1"
        assert b'"id":"chatcmpl-s-1"' in s.read()
    bad = httpx.post(stack.router.url + "/v1/chat/completions", json=body, headers={"x-request-id": "a b"})
    assert bad.status_code == 400 and "x-request-id" in bad.json()["error"]["message"]


def test_concurrent_requests_each_get_their_own_images(stack, oracle):
    cases = [
        [user_message(f"Image number {i}.", image_part(png_data_url(256, 256 + 32 * (i % 3), seed=100 + i)))]
        for i in range(12)
    ]
    c = client(stack)

    def run(messages):
        return c.chat.completions.create(model="tiny", messages=messages, max_tokens=16)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, cases, timeout=60))
    for messages, resp in zip(cases, results, strict=True):
        check_completion(resp, oracle, messages, 16)
    pools = stack.router.pools()
    assert sum(p["served"] for p in pools.values() if p["role"] == "pd") >= 12
    assert all(p["served"] > 0 for p in pools.values()), pools  # HRW + LOR spread the work
    assert all(p["inflight"] == 0 for p in pools.values())


def test_operations_endpoints(stack):
    url = stack.router.url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/ready").json() == {"ready": True}
    hc = httpx.get(url + "/healthcheck").json()
    assert hc == {"status": "ok", "ve_instances": 3, "pd_instances": 2, "ve_healthy": 3, "pd_healthy": 2}
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [str(stack.ckpt)]
    pools = httpx.get(url + "/pools").json()
    assert {e["id"] for e in pools["engines"]} == {"epd-ve-0", "epd-ve-1", "epd-ve-2", "epd-pd-0", "epd-pd-1"}
    assert set(pools["engines"][0]) >= {"id", "url", "role", "state", "healthy", "inflight", "served", "failures"}
    text = httpx.get(url + "/metrics").text
    for name in (
        "epd_router_requests_total",
        "epd_router_request_duration_seconds_bucket",
        "epd_router_time_to_first_token_seconds_bucket",
        "epd_router_preprocess_seconds_bucket",
        "epd_router_encode_seconds_bucket",
        "epd_router_pd_seconds_bucket",
        "epd_router_preprocess_cache_hits_total",
        "epd_router_dedupe_items_total",
    ):
        assert name in text, name
    # per-engine series carry the engine's model (the served name: here the checkpoint)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    model = ("model", str(stack.ckpt))
    assert ("epd_router_engine_inflight", (("engine", "epd-pd-0"), model, ("role", "pd"))) in samples
    assert samples[("epd_router_engine_healthy", (("engine", "epd-ve-2"), model, ("role", "ve")))] == 1.0
    # and so do the preprocess cache counters (each model's renderer has its own cache)
    assert ("epd_router_preprocess_cache_misses_total", (model,)) in samples
    out = subprocess.run(
        [str(Path(sys.executable).parent / "epd-router"), "status", "--url", url],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "ROLE", "STATE", "HEALTHY"]
    assert any(line.startswith("epd-pd-1") and " pd " in line for line in lines)
    assert "ready=true" in lines[-1]


def test_unknown_route_and_method_are_enveloped(stack):
    r = httpx.get(stack.router.url + "/v1/nothing")
    assert r.status_code == 404 and "no route /v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(stack.router.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_repeated_image_hits_the_same_ve_cache(stack, oracle):
    """HRW affinity: the same content hash lands on the same VE, whose encoder cache hits."""

    def hits() -> dict[str, float]:
        return {
            ve.engine_id: metric(httpx.get(ve.url + "/metrics").text, "epd_sim:encoder_cache_hits_total")
            for ve in stack.ves
        }

    messages = [user_message("What is this?", image_part(png_data_url(288, 256, seed=77)))]
    c = client(stack)
    before = hits()
    served_before = {k: v["served"] for k, v in stack.router.pools().items()}
    for _ in range(3):
        check_completion(c.chat.completions.create(model="tiny", messages=messages, max_tokens=8), oracle, messages, 8)
    after = hits()
    served = {k: v["served"] - served_before[k] for k, v in stack.router.pools().items() if k.startswith("epd-ve")}
    assert sorted(served.values()) == [0, 0, 3]  # one VE did all three encodes
    owner = max(served, key=served.get)
    assert after[owner] - before[owner] == 2  # the 2nd and 3rd were cache hits


def test_image_over_the_patch_budget_is_downscaled(stack, oracle):
    messages = [user_message("Big one.", image_part(png_data_url(1400, 900, seed=9)))]
    resp = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    rendered = check_completion(resp, oracle, messages, 8)
    assert rendered.items[0].num_patches <= 1024  # limits.max_image_patches default
