"""The exact VE/PD bodies (docs/contract.md §2.2, §3.1) and their JSON encoding."""

from __future__ import annotations

import json

from epd_kit.router import bodies
from epd_kit.router.bodies import ve_body
from epd_kit.wire import EcLocator, EcTransferItem, GenerateRequest


def test_ve_body_is_contract_exact(make_item):
    items = [make_item("h1", 15, 4, "K1", "P1"), make_item("h2", 40, 3, "K2", "P2")]
    body = json.loads(bytes(ve_body("rid", "epd-ve-1", items)))
    assert body == {
        "request_id": "rid/enc/epd-ve-1",
        "token_ids": [0] * 7,
        "features": {
            "mm_hashes": {"image": ["h1", "h2"]},
            "mm_placeholders": {"image": [{"offset": 0, "length": 4}, {"offset": 4, "length": 3}]},
            "kwargs_data": {"image": ["K1", "K2"]},
        },
        "sampling_params": {"max_tokens": 1},
    }
    GenerateRequest.model_validate(body)


def test_pd_body_keeps_duplicates_and_carries_locators(make_item):
    items = [make_item("h1", 2, 4, "K1", "P1"), make_item("h2", 8, 3, "K2", "P2"), make_item("h1", 12, 4, "K1", "P1")]
    loc = {
        h: EcLocator(engine_id="epd-ve-0", host="127.0.0.1", port=14600, remote_block_ids=[i], num_tokens=4)
        for i, h in enumerate(["h1", "h2"])
    }
    sampling = {"max_tokens": 5, "output_kind": 1, "extra_args": {"mine": 1, "kv_transfer_params": {"x": 1}}}
    body = bodies.pd_request_body("rid", list(range(20)), items, sampling, loc, stream=True)
    assert body["request_id"] == "rid" and body["token_ids"] == list(range(20))
    assert body["features"]["mm_hashes"] == {"image": ["h1", "h2", "h1"]}
    assert body["features"]["kwargs_data"] == {"image": ["P1", "P2", "P1"]}  # LM-only kwargs
    assert body["features"]["mm_placeholders"]["image"][2] == {"offset": 12, "length": 4}
    extra = body["sampling_params"]["extra_args"]
    assert extra["mine"] == 1 and set(extra["kv_transfer_params"]) == {"ec_locator"}
    assert extra["kv_transfer_params"]["ec_locator"]["h2"]["remote_block_ids"] == [1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    text_only = bodies.pd_request_body("r", [1, 2], [], {"output_kind": 2}, {}, stream=False)
    assert text_only["features"] == {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
    assert "stream" not in text_only
    assert text_only["sampling_params"]["extra_args"] == {"kv_transfer_params": {"ec_locator": {}}}


def test_a_pd_body_is_sent_as_compact_json(make_item):
    body = bodies.pd_request_body("r", [1], [make_item("h1", 0, 4, "K", "P")], {"output_kind": 2}, {}, stream=False)
    data = bodies.encode_body(body)
    assert json.loads(data) == body
    assert data == json.dumps(body, separators=(",", ":")).encode()


def _pd_body_through_the_models(request_id, token_ids, items, sampling, locators, stream):
    """What pd_request_body built before it skipped pydantic: the reference it must equal."""
    from epd_kit.wire import Features, Placeholder, SamplingParams, StreamOptions

    params = SamplingParams.model_validate(sampling).with_ec_locators(locators)
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        features=Features.of_images(
            [i.mm_hash for i in items],
            [Placeholder(offset=i.offset, length=i.length) for i in items],
            [i.pd_kwargs_b64 for i in items],
        ),
        sampling_params=params,
        stream=stream,
        stream_options=StreamOptions(include_usage=True) if stream else None,
    ).wire_dict()


def test_pd_body_equals_the_models_byte_for_byte(make_item):
    from epd_kit.router.openai_api import parse_request

    items = [make_item("h1", 2, 4, "K1", "P1"), make_item("h1", 12, 4, "K1", "P1")]
    loc = {"h1": EcLocator(engine_id="epd-ve-0", host="127.0.0.1", port=14600, remote_block_ids=[3], num_tokens=4)}
    requests = [
        {},
        {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": "x", "stop_token_ids": [5]},
        {"top_k": 5, "min_p": 0.1, "ignore_eos": True, "skip_special_tokens": False, "min_tokens": 1},
        {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "logprobs": True},
        {"extra_args": {"a": None, "b": {"c": None}, "kv_transfer_params": {"x": 1}}, "logit_bias": {"5": 1}},
        {"response_format": {"type": "json_object"}, "include_stop_str_in_output": True, "temperature": 1},
        {"structured_outputs": {"regex": "a+"}, "max_completion_tokens": 3, "stream": True},
    ]
    for extra in requests:
        request = parse_request({"messages": [{"role": "user", "content": "hi"}], **extra})
        sampling = request.sampling_params()
        for its, locs in (([], {}), (items, loc)):
            for stream in (False, True):
                got = bodies.pd_request_body("rid", [1, 2, 3], its, sampling, locs, stream)
                want = _pd_body_through_the_models("rid", [1, 2, 3], its, sampling, locs, stream)
                assert bodies.encode_body(got) == bodies.encode_body(want), (extra, stream)


UPSTREAM_ITEM = EcTransferItem(
    item_indices=[0], metadata={}, peer_host="127.0.0.1", peer_port=5600, size_bytes=4096, shape=[4, 8]
)


def test_pd_body_in_upstreams_handoff_carries_the_entries_top_level(make_item):
    """vLLM >= 0.30 (docs/contract.md "Hand-offs"): the VE's ec_transfer_params, unchanged, as the
    body's top-level ec_transfer_params; no kv_transfer_params anywhere; none for text only."""
    items = [make_item("h1", 2, 4, "K1", "P1"), make_item("h1", 12, 4, "K1", "P1")]
    sampling = {"max_tokens": 5, "extra_args": {"mine": 1, "kv_transfer_params": {"x": 1}}}
    body = bodies.pd_request_body(
        "rid", list(range(20)), items, sampling, {"h1": UPSTREAM_ITEM}, False, "ec_transfer_params"
    )
    assert body["ec_transfer_params"] == {"h1": UPSTREAM_ITEM.model_dump(exclude_unset=True)}
    assert body["sampling_params"]["extra_args"] == {"mine": 1}
    assert body["features"]["mm_hashes"] == {"image": ["h1", "h1"]}
    text_only = bodies.pd_request_body("r", [1, 2], [], {"output_kind": 2}, {}, False, "ec_transfer_params")
    assert "ec_transfer_params" not in text_only and text_only["sampling_params"]["extra_args"] == {}


def test_pd_body_in_upstreams_handoff_equals_the_models_byte_for_byte(make_item):
    from epd_kit.router.openai_api import parse_request
    from epd_kit.wire import Features, Placeholder, SamplingParams, StreamOptions, handoff_request_fields

    items = [make_item("h1", 2, 4, "K1", "P1")]
    for extra in ({}, {"extra_args": {"a": 1, "ec_transfer_params": {"h1": {}}}, "max_tokens": 3}):
        sampling = parse_request({"messages": [{"role": "user", "content": "hi"}], **extra}).sampling_params()
        for its, locs in (([], {}), (items, {"h1": UPSTREAM_ITEM})):
            for stream in (False, True):
                got = bodies.pd_request_body("rid", [1, 2, 3], its, sampling, locs, stream, "ec_transfer_params")
                extra_args, top = handoff_request_fields("ec_transfer_params", sampling.get("extra_args"), locs)
                want = GenerateRequest(
                    request_id="rid",
                    token_ids=[1, 2, 3],
                    features=Features.of_images(
                        [i.mm_hash for i in its],
                        [Placeholder(offset=i.offset, length=i.length) for i in its],
                        [i.pd_kwargs_b64 for i in its],
                    ),
                    sampling_params=SamplingParams.model_validate({**sampling, "extra_args": extra_args}),
                    stream=stream,
                    stream_options=StreamOptions(include_usage=True) if stream else None,
                    **top,
                ).wire_dict()
                assert bodies.encode_body(got) == bodies.encode_body(want), (extra, stream)
