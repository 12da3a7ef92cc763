"""Wire models: contract bodies parse, locators are strict, SSE framing survives chunking."""

import base64
import json

import pytest
from pydantic import ValidationError

from epd_kit import wire
from epd_kit.plan import neuron_releases

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


# --- the two hand-offs (docs/contract.md "Hand-offs") ---

# An entry as vLLM 0.32.0's producer announces it: distributed/ec_transfer/ec_connector/utils.py
# collect_ec_item_metadata builds {"item_indices": [...], "metadata": {...}} per mm_hash (every
# index of a repeated hash), and cpu/scheduler/__init__.py request_finished adds peer_host,
# peer_port, size_bytes and shape for an item it holds; for one it no longer holds it sets
# metadata {} and adds nothing
UPSTREAM_ENTRY = {
    "item_indices": [0, 2],
    "metadata": {"image_grid_thw": [1, 16, 16]},
    "peer_host": "10.213.0.11",
    "peer_port": 5600,
    "size_bytes": 2097152,
    "shape": [64, 2048],
}
UNANNOUNCED_ENTRY = {"item_indices": [1], "metadata": {}}


def test_the_handoff_kinds_are_the_planners():
    """The planner is stdlib only and spells the kinds itself (neuron_releases.HANDOFFS)."""
    assert wire.HANDOFF_KINDS == neuron_releases.HANDOFFS == ("ec_locator", "ec_transfer_params")


def test_an_upstream_entry_is_readable_only_with_the_producers_address():
    assert wire.EcTransferItem.model_validate(UPSTREAM_ENTRY).readable
    assert not wire.EcTransferItem.model_validate(UNANNOUNCED_ENTRY).readable
    for key in ("peer_host", "peer_port", "size_bytes", "shape"):  # the consumer needs each one
        partial = {k: v for k, v in UPSTREAM_ENTRY.items() if k != key}
        assert not wire.EcTransferItem.model_validate(partial).readable, key
    with pytest.raises(ValidationError):
        wire.EcTransferItem.model_validate({**UPSTREAM_ENTRY, "item_indices": []})
    with pytest.raises(ValidationError):
        wire.EcTransferItem.model_validate({**UPSTREAM_ENTRY, "peer_port": 70000})


def test_a_ve_answer_is_read_in_the_fleets_handoff_only():
    """vLLM 0.32.0 entrypoints/scale_out/token_in_token_out/protocol.py GenerateResponseBase: the
    producer's items in a top-level ec_transfer_params, kv_transfer_params null; vllm-neuron's
    under kv_transfer_params.ec_locator. Each kind reads its own place and nothing else."""
    upstream = wire.GenerateResponse.model_validate(
        {
            "request_id": "generate-tokens-r1/enc/ve",
            "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": []}],
            "kv_transfer_params": None,
            "ec_transfer_params": {"h": UPSTREAM_ENTRY, "g": UNANNOUNCED_ENTRY},
        }
    )
    items = upstream.handoff(wire.EC_TRANSFER_PARAMS)
    assert items["h"].model_dump(exclude_unset=True) == UPSTREAM_ENTRY
    assert wire.unreadable_items(items, ["h", "g", "absent"]) == ["g", "absent"]
    assert upstream.handoff(wire.EC_LOCATOR) == {}
    neuron = wire.GenerateResponse.model_validate(
        {"request_id": "x", "choices": [], "kv_transfer_params": {"ec_locator": {"h": LOC}}}
    )
    assert neuron.handoff(wire.EC_LOCATOR) == {"h": wire.EcLocator(**LOC)}
    assert neuron.handoff(wire.EC_TRANSFER_PARAMS) == {}
    with pytest.raises(ValueError, match="not a mapping"):
        wire.handoff_items(wire.EC_TRANSFER_PARAMS, None, ["h"])


def test_a_pd_body_carries_upstreams_entries_top_level_and_unchanged():
    """vLLM 0.32.0 protocol.py GenerateRequest.ec_transfer_params (top level); serving.py puts it in
    extra_args["ec_transfer_params"] and v1/request.py reads it (and kv_transfer_params) from
    there, so a client's own copies in extra_args are dropped."""
    item = wire.EcTransferItem.model_validate({**UPSTREAM_ENTRY, "future_key": 1})
    client = {"client": 1, "kv_transfer_params": {"x": 1}, "ec_transfer_params": {"h": {}}}
    extra, top = wire.handoff_request_fields(wire.EC_TRANSFER_PARAMS, client, {"h": item})
    assert extra == {"client": 1}
    assert top == {"ec_transfer_params": {"h": {**UPSTREAM_ENTRY, "future_key": 1}}}
    assert wire.handoff_request_fields(wire.EC_TRANSFER_PARAMS, None, {}) == ({}, {})  # text only: none
    body = wire.GenerateRequest(
        request_id="r1",
        token_ids=[1, 2, 3],
        features=wire.Features.of_images(["h"], [wire.Placeholder(offset=1, length=1)], ["a"]),
        sampling_params=wire.SamplingParams(max_tokens=8, extra_args=extra),
        **top,
    ).wire_dict()
    parsed = wire.GenerateRequest.model_validate(json.loads(json.dumps(body)))
    assert parsed.handoff(wire.EC_TRANSFER_PARAMS)["h"].model_dump(exclude_unset=True) == top["ec_transfer_params"]["h"]
    assert parsed.handoff(wire.EC_LOCATOR) == {}
    # vllm-neuron's: the locators under extra_args, nothing on top (test_pd_request_carries_...)
    extra, top = wire.handoff_request_fields(wire.EC_LOCATOR, client, {"h": wire.EcLocator(**LOC)})
    assert top == {} and extra["kv_transfer_params"] == {"ec_locator": {"h": LOC}} and extra["client"] == 1


def test_a_ve_answers_handoff_members_per_kind():
    item = wire.EcTransferItem.model_validate(UPSTREAM_ENTRY)
    assert wire.handoff_answer_fields(wire.EC_TRANSFER_PARAMS, {"h": item}) == {
        "kv_transfer_params": None,
        "ec_transfer_params": {"h": UPSTREAM_ENTRY},
    }
    assert wire.handoff_answer_fields(wire.EC_LOCATOR, {"h": wire.EcLocator(**LOC)}) == {
        "kv_transfer_params": {"ec_locator": {"h": LOC}}
    }
