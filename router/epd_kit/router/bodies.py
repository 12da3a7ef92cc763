"""The bodies the router POSTs to `/inference/v1/generate`: a VE's encode body (docs/contract.md
§2.2) and a PD's generate body (§3.1). Built here, sent by engine_client.py.

A VE body is megabytes of base64 pixels. The preprocessor caches each item's kwargs as
ready-to-send bytes, keyed by its mm_hash and bounded by the image cache; a body is those bytes
themselves between small JSON pieces (`VeBody.chunks`), so a repeated image costs no copy, no
JSON scan and no re-encoding on the router, only the send. Skipping the send for an item the VE
still holds is not done: see docs/preprocessing.md "Repeated images". A PD body carries only
the LM-side kwargs (a few bytes per image) and is one JSON document.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from epd_kit.router.rendering import PreparedItemLike
from epd_kit.wire import (
    EC_LOCATOR,
    EcHandoffItem,
    Features,
    HandoffKind,
    Placeholder,
    SamplingParams,
    encode_request_chunks,
    handoff_request_fields,
)


class VeBody:
    """One VE request body as the byte chunks to send in order; the items' kwargs are the
    cached bytes themselves. The engine client (engine_http.py) sends it with a
    `Content-Length` of `size`, the chunks one by one (only the first, small one joined with
    the request head), and can send it again for a resend. Joining them would copy megabytes
    per request."""

    __slots__ = ("chunks", "size")

    content_type = "application/json"

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self.chunks = tuple(chunks)
        self.size = sum(len(c) for c in self.chunks)

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks)


def ve_request_id(request_id: str, engine_id: str) -> str:
    """`<router request id>/enc/<VE id>` (docs/contract.md §2.2)."""
    return f"{request_id}/enc/{engine_id}"


def ve_body(request_id: str, engine_id: str, items: Sequence[PreparedItemLike]) -> VeBody:
    """The body of one encode POST to VE `engine_id`: synthetic zero prompt, contiguous
    placeholders, the full items, one token (docs/contract.md §2.2)."""
    entries = [(i.mm_hash, i.length, _ve_kwargs(i)) for i in items]
    return VeBody(encode_request_chunks(ve_request_id(request_id, engine_id), entries))


def _ve_kwargs(item: PreparedItemLike) -> bytes:
    """The item's cached base64 bytes (`PreparedItem.ve_kwargs`); an item that only has the
    text form (a test double) is encoded here."""
    cached = getattr(item, "ve_kwargs", None)
    return cached if isinstance(cached, bytes) else item.ve_kwargs_b64.encode("ascii")


def pd_request_body(
    request_id: str,
    token_ids: list[int],
    items: Sequence[PreparedItemLike],
    sampling: dict,
    locators: dict[str, EcHandoffItem],
    stream: bool,
    handoff: HandoffKind = EC_LOCATOR,
) -> dict:
    """Contract §3.1: real prompt, per-item placeholders with duplicates kept, LM-only
    kwargs, the items' hand-off in the fleet's kind (`handoff`, wire.handoff_request_fields):
    under sampling_params.extra_args.kv_transfer_params.ec_locator, or upstream's top-level
    ec_transfer_params.

    Built as builtins directly: the same dict, key for key and in the same order, as
    `GenerateRequest(...).wire_dict()` (tests/unit/router/test_router_bodies.py compares
    them), without a pydantic validate and dump per request. `sampling` is the router's own
    (`ChatCompletionRequest.sampling_params`), already validated."""
    if items:  # the image path keeps the model's alignment checks (its cost is elsewhere)
        features = Features.of_images(
            [i.mm_hash for i in items],
            [Placeholder(offset=i.offset, length=i.length) for i in items],
            [i.pd_kwargs_b64 for i in items],
        ).model_dump()
    else:
        features = {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
    extra, top = handoff_request_fields(handoff, sampling.get("extra_args"), locators)
    params = {}
    for name in _SAMPLING_DECLARED:
        if name == "extra_args":
            params[name] = extra
        elif (value := sampling.get(name)) is not None:
            params[name] = value
    params.update((k, v) for k, v in sampling.items() if k not in _SAMPLING_DECLARED and v is not None)
    body: dict = {"request_id": request_id, "token_ids": token_ids, "features": features, "sampling_params": params}
    body.update(top)
    if stream:  # we always ask for the usage chunk; the client sees it only if it asked (OpenAI rule)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# wire.SamplingParams' declared fields in declaration order: a dump lists them first, then
# the extra ones in the order given
_SAMPLING_DECLARED = tuple(SamplingParams.model_fields)


# json.dumps(doc, separators=(",", ":")), without building an encoder per call
_compact_json = json.JSONEncoder(separators=(",", ":")).encode


def encode_body(body: dict) -> bytes:
    """The JSON bytes of a PD body: compact, as the engines parse it."""
    return _compact_json(body).encode()
