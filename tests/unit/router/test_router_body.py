"""Request body decoding (router/body.py): the same document as `json.loads` for valid
bodies, inline image payloads kept apart as views of the body, and clear 400/413s for
surrogates, deep nesting, too many values and non-JSON constants. Includes a hypothesis
round trip."""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit.preprocess.settings import Limits
from epd_kit.router.body import LIFT_MIN_BYTES, decode_body
from epd_kit.router.errors import RouterError

LIMITS = Limits()
PAYLOAD = base64.b64encode(os.urandom(LIFT_MIN_BYTES)).decode()
IMAGE_URL = "data:image/png;base64," + PAYLOAD


def body_of(doc) -> bytes:
    return json.dumps(doc).encode()


def refused(raw: bytes, limits: Limits = LIMITS) -> RouterError:
    with pytest.raises(RouterError) as info:
        decode_body(raw, limits)
    return info.value


def test_an_inline_image_is_kept_apart_and_other_strings_come_back_whole():
    doc = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a text that quotes ;base64," + PAYLOAD},
                    {"type": "image_url", "image_url": {"url": IMAGE_URL}},
                    {"type": "image_url", "image_url": IMAGE_URL},
                ],
            }
        ],
        "key ;base64," + PAYLOAD: 1,
    }
    decoded = decode_body(body_of(doc), LIMITS)
    parts = decoded.doc["messages"][0]["content"]
    assert parts[0] == doc["messages"][0]["content"][0]  # not an image URL: restored verbatim
    assert ("key ;base64," + PAYLOAD) in decoded.doc
    for url in (parts[1]["image_url"]["url"], parts[2]["image_url"]):
        assert url.startswith("data:image/png;base64,") and len(url) < 64  # a marker, not 90 KB
        assert bytes(decoded.inline[url]) == PAYLOAD.encode()
    assert isinstance(decoded.inline[parts[2]["image_url"]], memoryview)


def test_short_payloads_go_through_the_parser_and_escaped_ones_are_lifted_unescaped():
    """A PNG whose base64 had '/' escaped (PHP's default) or was wrapped
    with \\n was not lifted, counted as text and got 413."""
    long_b64 = "A/" * LIFT_MIN_BYTES
    doc = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + long_b64}},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + PAYLOAD[:76] + "\n" + PAYLOAD},
                    },
                ],
            }
        ]
    }
    raw = body_of(doc).replace(b"A/", b"A\\/")  # some encoders escape '/'
    small = Limits(max_text_bytes=1024)  # the payloads alone are far bigger
    decoded = decode_body(raw, small)
    parts = decoded.doc["messages"][0]["content"]
    assert parts[0] == doc["messages"][0]["content"][0]
    assert bytes(decoded.inline[parts[1]["image_url"]["url"]]) == long_b64.encode()
    assert bytes(decoded.inline[parts[2]["image_url"]["url"]]) == (PAYLOAD[:76] + "\n" + PAYLOAD).encode()
    assert len(decoded.inline) == 2


def test_punctuation_inside_text_is_text_not_json_values():
    """A 40 KB prompt of 20,000 commas, or a 90 KB JSON document pasted
    into a prompt, tripped max_json_values (counted as all , : [ { bytes)."""
    pasted = json.dumps([{"k": i, "v": [i, i]} for i in range(6000)])
    for text in ("a," * 20_000, pasted):
        doc = {"messages": [{"role": "user", "content": text}]}
        assert decode_body(body_of(doc), LIMITS).doc == doc
    structure = b"[" + b",".join([b"{}"] * LIMITS.max_json_values) + b"]"
    assert refused(structure).status == 413  # real values are still counted


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"repetition_penalty": 1e400}', "repetition_penalty"),
        (b'{"extra_args": {"a": [1, -1e999]}}', "extra_args.a.1"),
        (b'{"structured_outputs": {"json": {"maximum": 1E+400}}}', "structured_outputs.json.maximum"),
    ],
)
def test_a_number_beyond_a_double_is_a_400_naming_the_field(raw, where):
    """1e400 parsed as infinity and reached the PD as `Infinity`."""
    err = refused(raw)
    assert err.status == 400 and err.param == where and "numbers must be finite" in err.message


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content: text"),
        (b'{"model": "\\udfff"}', "model: text"),
        (b'{"stop": ["ok", "\\ud83d"]}', "stop.1: text"),
        (b'{"extra_args": {"\\ud800": 1}}', "extra_args: a key"),
        ('{"messages": "\ud800"}'.encode("utf-8", "surrogatepass"), "messages: text"),  # raw CESU-8 bytes
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(raw, where):
    err = refused(raw)
    assert err.status == 400 and where in err.message and "lone UTF-16 surrogate" in err.message


def test_a_surrogate_pair_is_fine():
    assert decode_body(b'{"text": "\\ud83d\\ude00"}', LIMITS).doc == {"text": "\U0001f600"}


@pytest.mark.parametrize("depth", [33, 1000, 10_000])
def test_deep_nesting_is_a_400_not_a_recursion_error(depth):
    err = refused(b"[" * depth + b"]" * depth)
    assert err.status == 400 and "nested deeper than 32 levels" in err.message


def test_nesting_at_the_limit_is_accepted():
    assert decode_body(b"[" * 32 + b"]" * 32, LIMITS).doc is not None


def test_too_many_values_is_a_413_before_parsing():
    raw = b"[" + b",".join([b"{}"] * LIMITS.max_json_values) + b"]"
    err = refused(raw)
    assert err.status == 413 and "limits.max_json_values" in err.message
    huge_flat = b'{"a":[' + b"1," * 1_500_000 + b"1]}"
    assert refused(huge_flat).status == 413


@pytest.mark.parametrize("raw", [b'{"t": NaN}', b'{"t": Infinity}', b"[-Infinity]"])
def test_nan_and_infinity_are_not_json(raw):
    err = refused(raw)
    assert err.status == 400 and "is not a JSON value" in err.message


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe\x00", b'{"a":1}}', b"\x00" * 10])
def test_broken_json_is_a_400(raw):
    assert refused(raw).status == 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _refusal(doc: object) -> str | None:
    """Why decode_body must refuse a document json.loads takes, if it must."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            return "surrogate"
        if isinstance(value, dict | list):
            if depth > LIMITS.max_json_depth:
                return "nested deeper"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                stack += [(key, depth), (child, depth + 1)]
    return None


@settings(max_examples=150, deadline=None)
@given(doc=json_values)
def test_valid_documents_decode_like_json_loads(doc):
    raw = json.dumps(doc).encode()
    refusal = _refusal(json.loads(raw))
    if refusal is None:
        assert decode_body(raw, LIMITS).doc == json.loads(raw)
    else:
        assert refusal in refused(raw).message


def test_the_text_limit_counts_characters_a_json_escape_as_one():
    """A prompt of 300,000 non-ASCII characters is 1.8 MB as json.dumps
    writes it (\\uXXXX each) and was a 413 under the 1 MiB limit; it is 300,000 characters."""
    doc = {"messages": [{"role": "user", "content": "é" * 300_000}]}
    assert decode_body(body_of(doc), LIMITS).doc == doc
    over = refused(body_of({"messages": [{"role": "user", "content": "a" * (LIMITS.max_text_bytes + 10)}]}))
    assert over.status == 413 and "characters (limits.max_text_bytes)" in over.message
    flood = refused(body_of({"messages": [{"role": "user", "content": "\\" * (4 * LIMITS.max_text_bytes)}]}))
    assert flood.status == 413 and "bytes, above the limit" in flood.message  # 8 MiB: refused by size
