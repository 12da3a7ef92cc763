"""Fuzz the HTTP API (hypothesis, bounded examples) against a live router + sims:
no 5xx that is the router's own fault (500), no crash, every 4xx carries a message and the
request id. The strategies include lone surrogates, deep nesting, huge flat bodies and
malformed HTTP (raw sockets); bench/hostile.py is the big named run."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_kit.testing.images import png_data_url

from .harness import Stack

TINY_PNG = png_data_url(40, 30, seed=5)

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "\udc00\ud800"])
text = st.one_of(st.text(max_size=20), SURROGATES)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), text)
json_value = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)
urls = st.one_of(
    st.just(TINY_PNG),
    st.just("data:image/png;base64,AAAA"),
    st.just("data:image/png;base64,!!!"),
    st.just("data:text/plain;base64,aGVsbG8="),
    st.just("http://127.0.0.1:1/x.png"),
    st.just("file:///etc/passwd"),
    st.text(max_size=30),
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": urls})}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "video_url", "bogus"])}),
    json_value,
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
            "content": st.one_of(text, st.lists(part, max_size=3), st.none(), json_value),
        }
    ),
    json_value,
)
request = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_value)},
    optional={
        "model": st.one_of(st.text(max_size=10), SURROGATES, json_value),
        "max_tokens": st.one_of(st.integers(-3, 24), st.integers(10**5, 10**12), json_value),
        "temperature": st.one_of(st.floats(-1, 3), json_value),
        "top_p": st.floats(-0.5, 1.5),
        "n": st.integers(-1, 3),
        "stream": st.one_of(st.booleans(), json_value),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_value),
        "stop": st.one_of(text, st.lists(text, max_size=20), json_value),
        "seed": st.one_of(st.integers(-(2**64), 2**64), json_value),
        "logprobs": st.one_of(st.booleans(), json_value),
        "top_logprobs": st.integers(-2, 30),
        "extra_args": json_value,
    },
)


@pytest.fixture(scope="module")
def http(stack: Stack):
    with httpx.Client(base_url=stack.router.url, timeout=30) as c:
        yield c


def check(resp: httpx.Response) -> None:
    assert resp.status_code != 500, resp.text[:500]
    assert resp.status_code in (200, 400, 404, 405, 413, 422, 429, 503), resp.text[:500]
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and len(err["message"]) > 5
        assert err["code"] == resp.status_code and resp.json()["request_id"]
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.text.endswith("data: [DONE]\n\n")
        assert '"code":500' not in resp.text, resp.text[-500:]
    else:
        assert resp.json()["object"] == "chat.completion"


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=request)
def test_fuzz_structured_requests(http, body):
    if isinstance(body.get("max_tokens"), int) and isinstance(body.get("stream"), bool):
        pass  # no special casing: every combination must be handled
    check(http.post("/v1/chat/completions", content=json.dumps(body)))


IMAGES = [png_data_url(64 + 48 * i, 48 + 32 * i, seed=i) for i in range(3)]
valid_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
    st.sampled_from(IMAGES).map(lambda u: {"type": "image_url", "image_url": {"url": u}}),
)
valid_request = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": st.one_of(st.text(max_size=40), st.lists(valid_part, min_size=1, max_size=4)),
                }
            ),
            min_size=1,
            max_size=3,
        )
    },
    optional={
        "max_tokens": st.integers(1, 32),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50),
        "n": st.just(1),
        "seed": st.integers(0, 2**31),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 900), max_size=3),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "stream": st.booleans(),
    },
).map(lambda b: {**b, "max_tokens": b.get("max_tokens", 8)})


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=valid_request)
def test_fuzz_valid_requests_succeed(http, body):
    """Well-formed requests (text, images, sampling knobs, streaming) are answered: 200, or a
    400 only for content the model cannot take (e.g. a system message that is not first)."""
    resp = http.post("/v1/chat/completions", json=body)
    check(resp)
    if resp.status_code == 400:
        assert "messages" in (resp.json()["error"]["param"] or ""), resp.text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode())))
def test_fuzz_raw_bodies(http, raw):
    check(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}))


def test_oversized_body_is_413(http, stack):
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (64 * 1024 * 1024 + 10) + b'"}]}'
    resp = http.post("/v1/chat/completions", content=huge)
    assert resp.status_code == 413 and "exceeds the limit" in resp.json()["error"]["message"]


def test_bad_image_is_400_with_where(http):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert "messages[0].content[1]" in err["message"] and err["param"]


def test_too_many_images_is_400(http):
    parts = [{"type": "image_url", "image_url": {"url": TINY_PNG}}] * 31
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert resp.status_code == 400
    assert "31 images in one request, above the limit of 30" in resp.json()["error"]["message"]


def nested(depth: int, where: str) -> bytes:
    inner = b"[" * depth + b"]" * depth
    if where == "top":
        return inner
    return b'{"messages":[{"role":"user","content":"x"}],"' + where.encode() + b'":' + inner + b"}"


def flat(count: int, item: bytes) -> bytes:
    return b'{"messages":[{"role":"user","content":"x"}],"extra_args":{"a":[' + b",".join([item] * count) + b"]}}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.one_of(
        st.builds(nested, st.integers(20, 5000), st.sampled_from(["top", "extra_args", "stop", "model"])),
        st.builds(flat, st.integers(1000, 200_000), st.sampled_from([b"1", b"{}", b'{"a":[]}', b'""', b"null"])),
    )
)
def test_fuzz_deep_and_huge_flat_bodies(http, raw):
    check(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}))


token = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=12)
header_value = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from([b"POST", b"GET", b"PUT", b"BREW", b"", b"P\x00ST"]),
    target=st.sampled_from([b"/v1/chat/completions", b"/", b"*", b"/\xff", b"/%00", b"http://x/v1", b""]),
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1x", b""]),
    headers=st.lists(st.tuples(token.map(str.encode), header_value), max_size=6),
    length=st.sampled_from([None, b"0", b"-1", b"abc", b"2", b"99999999999999999999"]),
)
def test_fuzz_malformed_http(stack, method, target, version, headers, length):
    """Raw request heads: the router answers an HTTP status (never a 500) or closes, and keeps
    serving."""
    head = method + b" " + target + b" " + version + b"\r\nHost: x\r\nConnection: close\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    if length is not None:
        head += b"Content-Length: " + length + b"\r\n"
    with socket.create_connection(("127.0.0.1", stack.router.port), timeout=10) as sock:
        sock.sendall(head + b"\r\n{}")
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            pass  # waiting for a body that never comes: the listener's body timeout ends it
    if answer:
        assert answer.startswith(b"HTTP/1.1 ") and not answer.startswith(b"HTTP/1.1 500"), answer[:200]
        status = int(answer[9:12])
        if status >= 400:
            body = answer.partition(b"\r\n\r\n")[2]
            assert json.loads(body)["error"]["code"] == status
