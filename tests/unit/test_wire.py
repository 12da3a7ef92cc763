"""Wire models: contract bodies parse, locators are strict, SSE framing survives chunking."""

import base64
import json

import pytest
from pydantic import ValidationError

from epd_kit import wire

LOC = {"engine_id": "epd-ve-1", "host": "127.0.0.1", "port": 14604, "remote_block_ids": [17], "num_tokens": 176}


def test_pd_request_carries_locators_under_extra_args():
    sp = wire.SamplingParams(max_tokens=8, extra_args={"client": 1, "kv_transfer_params": {"old": True}})
    sp = sp.with_ec_locators({"h": wire.EcLocator(**LOC)})
    body = wire.GenerateRequest(
        request_id="r1",
        token_ids=[1, 2, 3],
        features=wire.Features.of_images(["h"], [wire.Placeholder(offset=1, length=1)], ["a"]),
        sampling_params=sp,
        stream=True,
        stream_options=wire.StreamOptions(include_usage=True),
    ).wire_dict()
    assert body["sampling_params"]["extra_args"] == {"client": 1, "kv_transfer_params": {"ec_locator": {"h": LOC}}}
    assert body["stream_options"] == {"include_usage": True}
    parsed = wire.GenerateRequest.model_validate(json.loads(json.dumps(body)))
    assert parsed.sampling_params.ec_locators()["h"].port == 14604


def test_text_only_features_are_empty_but_present():
    body = wire.GenerateRequest(token_ids=[5]).wire_dict()
    assert body["features"] == {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}


def test_locator_with_extra_key_is_rejected():
    with pytest.raises(ValidationError):
        wire.EcLocator(**LOC, dtype="bf16")


def test_misaligned_features_rejected():
    with pytest.raises(ValidationError, match="not aligned"):
        wire.Features(
            mm_hashes={"image": ["a", "b"]},
            mm_placeholders={"image": [{"offset": 0, "length": 1}]},
            kwargs_data={"image": ["x", "y"]},
        )


def test_ve_response_locators():
    resp = wire.GenerateResponse.model_validate(
        {
            "request_id": "x",
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": [0]}],
            "kv_transfer_params": {"ec_locator": {"h": LOC}},
        }
    )
    assert resp.ec_locators()["h"] == wire.EcLocator(**LOC)


def test_sse_split_across_multibyte_boundary():
    payload = json.dumps({"t": "é漢"}, ensure_ascii=False).encode()
    stream = b"data: " + payload + b"\n\n" + wire.SSE_DONE
    chunks = [stream[i : i + 3] for i in range(0, len(stream), 3)]
    assert wire.iter_sse_payloads_sync(chunks) == [payload]
    assert json.loads(wire.iter_sse_payloads_sync(chunks)[0])["t"] == "é漢"


def test_sse_frame_is_lf_only_ascii():
    frame = wire.sse_frame({"t": "é"})
    assert frame.endswith(b"\n\n") and b"\r" not in frame and frame.isascii()


def test_ve_body_chunks_pass_the_items_through_and_join_to_the_body():
    kwargs = [base64.b64encode(bytes(range(256)) * 40), b"QUJD"]
    items = [("a" * 64, 256, kwargs[0]), ("b" * 64, 16, kwargs[1])]
    for some in (items[:1], items):
        chunks = wire.encode_request_chunks("rid/enc/epd-ve-0", some)
        as_text = [(h, n, k.decode()) for h, n, k in some]
        body = wire.encode_request("rid/enc/epd-ve-0", as_text).wire_dict()
        assert b"".join(chunks) == json.dumps(body, separators=(",", ":")).encode()
        assert all(any(c is k for c in chunks) for _, _, k in some)  # the objects, not copies
