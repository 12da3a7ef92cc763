"""`kwargs_data` items both ways between the kit's codec (epd_kit.mm_serde) and the
`mm_serde` of the vLLM this run has (0.24 or 0.29): the router's items through vLLM's decoder
and encoder, vLLM's own items (from its processor, `/v1/chat/completions/render`) through the
kit's decoder and the simulated VE."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np
import pytest
from vllm.multimodal.inputs import MultiModalKwargsItem

from epd_kit import mm_serde, wire
from tests.compat.cases import CHATS, image_features
from tests.compat.sim_engines import SimPair, ve_items
from tests.compat.stack import CompatStack
from tests.compat.vllm_api import decode_mm_kwargs_item, encode_mm_kwargs_item

CHAT = "several-images"


@pytest.fixture(scope="module")
def vllm_items(stack: CompatStack) -> list[tuple[str, int, str]]:
    """(mm_hash, length, kwargs_b64) of vLLM's own items for CHAT (bfloat16 pixels: the tutorial's dtype)."""
    return [(h, length, k) for h, _, length, k in image_features(stack.render(CHATS[CHAT]))]


def _as_float32(kwargs_b64: str) -> str:
    """vLLM's item with pixel_values cast to float32, encoded again by vLLM: what vLLM sends
    for an engine running in float32."""
    item = decode_mm_kwargs_item(kwargs_b64)
    fields = {
        key: dataclasses.replace(elem, data=elem.data.float()) if key == "pixel_values" else elem
        for key, elem in item.items()
    }
    return encode_mm_kwargs_item(MultiModalKwargsItem(fields))


def _ve_body(items: list[tuple[str, int, str]]) -> dict[str, Any]:
    return wire.encode_request(f"{uuid.uuid4().hex}/enc/compat", items).wire_dict()


def test_router_items_survive_vllms_serde_byte_for_byte(stack: CompatStack) -> None:
    """vLLM reads the router's strings and writes them back unchanged (same layout, same
    bytes): the byte-compat check tests/unit can only skip."""
    ex = stack.chat(CHATS[CHAT])
    items = [k for body in (*ex.ve_bodies, *ex.pd_bodies) for *_, k in image_features(body)]
    assert len(items) == 6  # 3 VE items + 3 PD items
    for ours in items:
        assert encode_mm_kwargs_item(decode_mm_kwargs_item(ours)) == ours


def test_the_kit_decodes_vllm_encoded_float32_items(vllm_items) -> None:
    for _, _, kwargs_b64 in vllm_items:
        encoded = _as_float32(kwargs_b64)
        theirs, ours = decode_mm_kwargs_item(encoded), mm_serde.decode_item_b64(encoded)
        # vLLM's field order follows the string hash seed, so it is no part of the contract
        assert list(ours) == list(theirs) and set(ours) == {"pixel_values", "image_grid_thw"}
        for key, elem in ours.items():
            np.testing.assert_array_equal(elem.data, theirs[key].data.numpy())
            assert elem.spec.kwargs["keep_on_cpu"] == theirs[key].field.keep_on_cpu
        assert mm_serde.encode_item_b64(ours) == encoded  # and writes vLLM's bytes back


def test_the_kit_decodes_vllm_encoded_bfloat16_items(vllm_items) -> None:
    for _, _, kwargs_b64 in vllm_items:
        ours = mm_serde.decode_item_b64(kwargs_b64)
        grid = decode_mm_kwargs_item(kwargs_b64)["image_grid_thw"].data.tolist()
        assert list(mm_serde.grid_thw(ours)) == grid
        assert mm_serde.encode_item_b64(ours) == kwargs_b64  # the 16-bit words kept as they came


def _encodes(sims: SimPair, items: list[tuple[str, int, str]]) -> None:
    resp = sims.ve.generate(_ve_body(items))
    assert resp.status_code == 200, resp.text
    assert set(ve_items(resp.json())) == {h for h, _, _ in items}


def test_the_sim_ve_encodes_vllm_encoded_float32_items(vllm_items, sims: SimPair) -> None:
    _encodes(sims, [(h, length, _as_float32(k)) for h, length, k in vllm_items])


def test_the_sim_ve_encodes_vllm_encoded_bfloat16_items(vllm_items, sims: SimPair) -> None:
    _encodes(sims, vllm_items)
