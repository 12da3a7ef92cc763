"""The router's real VE and PD bodies through the real `/inference/v1/generate` of the vLLM this
run has (0.24 or 0.29): its request model, `mm_serde` decoding, input processor and `Request`
construction (only the engine core is a stand-in), and vLLM's answers back through the router
to the client."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from vllm.sampling_params import RequestOutputKind

from epd_kit import mm_serde
from tests.compat.cases import CHATS, IMAGE_CHATS, IMAGES, image_features
from tests.compat.engine_core import OUTPUT_TOKENS
from tests.compat.stack import CompatStack, Exchange

MAX_TOKENS = 4


def _features(request: Any) -> list[tuple[str, int, int]]:
    return [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in request.mm_features]


def _tensor(request_feature: Any, key: str) -> np.ndarray:
    """The tensor vLLM holds, bfloat16 as its raw words (mm_serde.BFLOAT16), as the kit holds it."""
    data = request_feature.data[key].data
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(mm_serde.BFLOAT16)
    return data.numpy()


@pytest.fixture(scope="module", params=[False, True], ids=["non-stream", "stream"])
def exchanges(request: pytest.FixtureRequest, stack: CompatStack) -> dict[str, Exchange]:
    return {name: stack.chat(messages, stream=request.param, max_tokens=MAX_TOKENS) for name, messages in CHATS.items()}


@pytest.mark.parametrize("chat", CHATS)
def test_the_client_gets_what_the_engine_generated(chat: str, exchanges: dict[str, Exchange], checkpoint) -> None:
    ex = exchanges[chat]
    assert ex.status == 200, ex.body
    expected = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode(list(OUTPUT_TOKENS[:MAX_TOKENS]))
    if ex.frames:
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in ex.frames if f.get("choices"))
        finish = [f["choices"][0]["finish_reason"] for f in ex.frames if f.get("choices")][-1]
    else:
        text, finish = ex.body["choices"][0]["message"]["content"], ex.body["choices"][0]["finish_reason"]
    assert (text, finish) == (expected, "length")


@pytest.mark.parametrize("chat", IMAGE_CHATS)
def test_ve_body_becomes_the_request_vllm_schedules(chat: str, exchanges: dict[str, Exchange]) -> None:
    ex = exchanges[chat]
    assert len(ex.ve_bodies) == len(ex.ve_requests) == 1  # one VE: one POST for all its items
    body, request = ex.ve_bodies[0], ex.ve_requests[0]
    items = image_features(body)
    assert len({h for h, *_ in items}) == len(items) == IMAGES[chat][1]  # distinct images only
    assert request.prompt_token_ids == body["token_ids"]
    assert _features(request) == [(h, off, length) for h, off, length, _ in items]
    for feature, (_, _, _, kwargs_b64) in zip(request.mm_features, items, strict=True):
        ours = mm_serde.decode_item_b64(kwargs_b64)
        assert list(feature.data) == list(ours) == ["pixel_values", "image_grid_thw"]
        for key, elem in ours.items():
            np.testing.assert_array_equal(_tensor(feature, key), elem.data)
        assert type(feature.data["pixel_values"].field).__name__ == "MultiModalFlatField"
        assert type(feature.data["image_grid_thw"].field).__name__ == "MultiModalBatchedField"
    assert request.sampling_params.max_tokens == 1


def test_text_only_reaches_no_ve(exchanges: dict[str, Exchange]) -> None:
    ex = exchanges["text-only"]
    assert ex.ve_bodies == [] and len(ex.pd_requests) == 1
    assert ex.pd_requests[0].mm_features == []


@pytest.mark.parametrize("chat", CHATS)
def test_pd_body_becomes_the_request_vllm_schedules(chat: str, exchanges: dict[str, Exchange]) -> None:
    ex = exchanges[chat]
    assert len(ex.pd_bodies) == len(ex.pd_requests) == 1
    body, request = ex.pd_bodies[0], ex.pd_requests[0]
    items = image_features(body)
    assert (len(items), len({h for h, *_ in items})) == IMAGES[chat]  # prompt order, duplicates kept
    assert request.prompt_token_ids == body["token_ids"]
    assert _features(request) == [(h, off, length) for h, off, length, _ in items]
    ve_grids = {f.identifier: _tensor(f, "image_grid_thw") for r in ex.ve_requests for f in r.mm_features}
    for feature in request.mm_features:
        assert list(feature.data) == ["image_grid_thw"]  # the LM-only item
        np.testing.assert_array_equal(_tensor(feature, "image_grid_thw"), ve_grids[feature.identifier])

    params = request.sampling_params
    locators = params.extra_args["kv_transfer_params"]["ec_locator"]
    assert set(locators) == {h for h, *_ in items}
    lengths = {h: length for h, _, length, _ in items}
    assert all(loc["engine_id"] == "epd-ve-0" and loc["num_tokens"] == lengths[h] for h, loc in locators.items())
    assert params.max_tokens == MAX_TOKENS and params.temperature == 0.0
    stream = bool(ex.frames)
    assert params.output_kind == (RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
