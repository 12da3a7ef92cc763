"""The VE/PD wire contract: the one module both the router and the simulated engine use.

Every body that crosses `POST /inference/v1/generate` (docs/contract.md §2 for the vision encoder,
§3 for prefill+decode) is modelled here, together with the SSE framing both sides speak.
Models accept what the reference sends and refuse shapes that would break the contract
(a locator with unknown keys, a placeholder list that does not line up with its hashes).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

GENERATE_PATH = "/inference/v1/generate"
# the paths an engine started with an API key checks it on (never OPTIONS): vllm 0.24.0
# entrypoints/serve/utils/server_utils.py:41 GUARDED_PREFIX; 0.29.0 adds "/cohere"
# (entrypoints/serve/middleware/authenticate.py:11). docs/security.md "Engine keys".
KEY_GUARDED_PATHS = ("/v1", "/v2", "/inference")
KEY_GUARDED_PATHS_0_29 = (*KEY_GUARDED_PATHS, "/cohere")
MODALITY_IMAGE = "image"  # the reference labels every item "image" (docs/contract.md §2.2)
SSE_DONE = b"data: [DONE]\n\n"

# vLLM's error answers, as the simulated engine sends them (sim/errors.py, sim/release.py) and the
# router reads them (router/upstream.py, which says how each is told apart).
# Once its engine core died, whatever killed it, vLLM's API server answers every request with this
# (vllm/v1/engine/exceptions.py EngineDeadError, 0.24.0 and 0.29.0): a 500 {"error": {"message":
# this, "type": "InternalServerError", "code": 500}}, or in a stream that error event and [DONE].
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# One request's failed generation (a choice finished with reason "error"): GenerationError("Internal
# server error") through create_error_response, the same in both releases (0.24.0
# entrypoints/openai/engine/serving.py:117-134, 0.29.0 entrypoints/generate/base/serving.py:204-221)
GENERATION_ERROR_MESSAGE = "Internal server error"
INTERNAL_SERVER_ERROR = "InternalServerError"  # the error type of both
# How the Neuron EC connector's handshake refuses a VE whose blocks differ from the PD's
# (docs/contract.md §3.5, "EC region block_len mismatch: remote engine ... advertises ..."): the
# sim's PD says it so (sim/ec_loader.py), the router reads it as a failed read (router/upstream.py)
EC_BLOCK_LEN_MISMATCH = "EC region block_len mismatch"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Engines add fields across vLLM versions; keep and pass them through."""

    model_config = ConfigDict(extra="allow")


class Placeholder(_Strict):
    """Where an item's embedding rows sit in `token_ids`."""

    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class EcLocator(_Strict):
    """Where a VE keeps one encoded item: exactly the five keys of docs/contract.md §2.4."""

    engine_id: str = Field(min_length=1)
    host: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    remote_block_ids: list[int] = Field(min_length=1)
    num_tokens: int = Field(gt=0)

    @property
    def readable(self) -> bool:
        """Every key is required: a locator that parsed names blocks a PD can read."""
        return True


# The two hand-offs of an item's encoder output from a VE to a PD (docs/contract.md §2.7;
# a fleet speaks one, router.yaml `handoff`, derived by the planner from the engines' vLLM):
# - ec_locator: vllm-neuron's EC connector (Neuron 2.32 and 2.33, vLLM 0.24.0 and 0.29.0). The VE
#   answers `kv_transfer_params.ec_locator` {mm_hash: EcLocator}; the PD reads the same mapping
#   from `sampling_params.extra_args.kv_transfer_params.ec_locator` (§2.4, §3.1).
# - ec_transfer_params: upstream vLLM >= 0.30 (ECCPUConnector with "ec_enable_nixl", vllm PR
#   #47941). The VE answers a top-level `ec_transfer_params` {mm_hash: EcTransferItem} with
#   `kv_transfer_params` null, and the PD takes that mapping as its request's top-level
#   `ec_transfer_params` (vLLM 0.32.0 entrypoints/scale_out/token_in_token_out/protocol.py:
#   GenerateRequest.ec_transfer_params and GenerateResponseBase.ec_transfer_params; serving.py
#   copies the request's into sampling_params.extra_args["ec_transfer_params"], which
#   v1/request.py reads into Request.ec_transfer_params).
HandoffKind = Literal["ec_locator", "ec_transfer_params"]
EC_LOCATOR: HandoffKind = "ec_locator"
EC_TRANSFER_PARAMS: HandoffKind = "ec_transfer_params"
HANDOFF_KINDS: tuple[HandoffKind, ...] = get_args(HandoffKind)


class EcTransferItem(_Open):
    """One item of upstream's `ec_transfer_params`, as vLLM 0.32.0's producer announces it
    (distributed/ec_transfer/ec_connector/cpu/scheduler/__init__.py request_finished: the entry
    of utils.py collect_ec_item_metadata, `item_indices` and `metadata`, updated with
    `peer_host`, `peer_port`, `size_bytes`, `shape`). Other keys are kept: the PD gets the entry
    as the VE wrote it."""

    item_indices: list[int] = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    peer_host: str | None = Field(default=None, min_length=1)
    peer_port: int | None = Field(default=None, gt=0, lt=65536)
    size_bytes: int | None = Field(default=None, gt=0)
    shape: list[int] | None = None

    @property
    def readable(self) -> bool:
        """Whether a PD can fetch it. An entry without the address is what the producer writes
        for an item it no longer holds ("announcing no metadata", request_finished); the
        consumer then encodes the item itself (cpu/scheduler/__init__.py _admit_item: "Without
        a producer address ... the encoder runs locally"), which the router's LM-only kwargs
        cannot feed: the PD's engine core dies (issue 54). Without size_bytes or shape the
        consumer gives the read up (_RemoteUnavailable) and, with no media, fails the request."""
        return None not in (self.peer_host, self.peer_port, self.size_bytes, self.shape)


EcHandoffItem = EcLocator | EcTransferItem


def handoff_items(
    kind: HandoffKind, kv_transfer_params: object, ec_transfer_params: object
) -> dict[str, EcHandoffItem]:
    """The items of one hand-off, read where `kind` carries them (a VE's answer, a PD's body).
    ValueError (pydantic's ValidationError is one) for a malformed mapping."""
    if kind == EC_LOCATOR:
        raw = kv_transfer_params.get("ec_locator") if isinstance(kv_transfer_params, dict) else None
        model: type[EcLocator | EcTransferItem] = EcLocator
    else:
        raw, model = ec_transfer_params, EcTransferItem
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{kind} is not a mapping of mm_hash to its entry")
    return {str(h): model.model_validate(entry) for h, entry in raw.items()}


def unreadable_items(items: dict[str, EcHandoffItem], hashes: Iterable[str]) -> list[str]:
    """The `hashes` a PD could not fetch from `items`: absent, or without an address."""
    return [h for h in hashes if h not in items or not items[h].readable]


def _dump(items: dict[str, EcHandoffItem]) -> dict[str, dict[str, Any]]:
    # exclude_unset: an entry goes on exactly as the VE wrote it (and a sim's as it built it)
    return {h: item.model_dump(exclude_unset=True) for h, item in items.items()}


def handoff_answer_fields(kind: HandoffKind, items: dict[str, EcHandoffItem]) -> dict[str, Any]:
    """A VE answer's hand-off members: vllm-neuron's `kv_transfer_params.ec_locator`, or
    upstream's top-level `ec_transfer_params` beside a null `kv_transfer_params`."""
    if kind == EC_LOCATOR:
        return {"kv_transfer_params": {"ec_locator": _dump(items)}}
    return {"kv_transfer_params": None, "ec_transfer_params": _dump(items)}


def handoff_request_fields(
    kind: HandoffKind, extra_args: dict[str, Any] | None, items: dict[str, EcHandoffItem]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A PD body's hand-off: (its sampling_params.extra_args, its top-level members). The
    router's own `kv_transfer_params` replaces a client's wholesale (§3.1); with upstream's
    hand-off a client's `kv_transfer_params` and `ec_transfer_params` in extra_args are dropped
    (vLLM 0.32.0 v1/request.py reads both from there), and `ec_transfer_params` goes on top only
    when the request has items (a text-only request carries none, as vLLM's default null)."""
    if kind == EC_LOCATOR:
        extra = dict(extra_args or {})
        extra["kv_transfer_params"] = {"ec_locator": _dump(items)}
        return extra, {}
    extra = {k: v for k, v in (extra_args or {}).items() if k not in ("kv_transfer_params", "ec_transfer_params")}
    return extra, ({"ec_transfer_params": _dump(items)} if items else {})


class Features(_Strict):
    """Per-modality, index-aligned item lists (docs/contract.md §2.2 / §3.1)."""

    mm_hashes: dict[str, list[str]] = Field(default_factory=dict)
    mm_placeholders: dict[str, list[Placeholder]] = Field(default_factory=dict)
    kwargs_data: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> Features:
        for modality, hashes in self.mm_hashes.items():
            n_ph = len(self.mm_placeholders.get(modality, []))
            n_kw = len(self.kwargs_data.get(modality, []))
            if not len(hashes) == n_ph == n_kw:
                raise ValueError(
                    f"features for {modality!r} are not aligned: {len(hashes)} hashes, "
                    f"{n_ph} placeholders, {n_kw} kwargs_data entries"
                )
        extra = (set(self.mm_placeholders) | set(self.kwargs_data)) - set(self.mm_hashes)
        if any(self.mm_placeholders.get(m) or self.kwargs_data.get(m) for m in extra):
            raise ValueError(f"features for {sorted(extra)} have no mm_hashes")
        return self

    def items(self) -> list[tuple[str, str, Placeholder, str]]:
        """(modality, mm_hash, placeholder, kwargs_b64) in prompt order, duplicates kept."""
        out = []
        for modality, hashes in self.mm_hashes.items():
            phs = self.mm_placeholders[modality]
            kws = self.kwargs_data[modality]
            out.extend((modality, h, p, k) for h, p, k in zip(hashes, phs, kws, strict=True))
        return out

    @classmethod
    def of_images(cls, hashes: list[str], placeholders: list[Placeholder], kwargs_b64: list[str]) -> Features:
        if not hashes:
            return cls()
        return cls(
            mm_hashes={MODALITY_IMAGE: hashes},
            mm_placeholders={MODALITY_IMAGE: placeholders},
            kwargs_data={MODALITY_IMAGE: kwargs_b64},
        )


class StreamOptions(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingParams(_Open):
    """vLLM SamplingParams as plain builtins: only non-default fields are present."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    output_kind: int | None = None
    extra_args: dict[str, Any] | None = None

    def ec_locators(self) -> dict[str, EcLocator]:
        """The locators a PD reads: `extra_args.kv_transfer_params.ec_locator` (§3.1)."""
        items = handoff_items(EC_LOCATOR, (self.extra_args or {}).get("kv_transfer_params"), None)
        return {h: item for h, item in items.items() if isinstance(item, EcLocator)}

    def with_ec_locators(self, locators: dict[str, EcLocator]) -> SamplingParams:
        """Copy with `kv_transfer_params` replaced wholesale, client extra_args kept (§3.1)."""
        extra, _ = handoff_request_fields(EC_LOCATOR, self.extra_args, dict(locators))
        return self.model_copy(update={"extra_args": extra})

    def wire_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class GenerateRequest(_Open):
    """Body of `POST /inference/v1/generate` on both pools."""

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    features: Features | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    # upstream's hand-off (HandoffKind "ec_transfer_params"): the VEs' entries, by mm_hash
    ec_transfer_params: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def handoff(self, kind: HandoffKind) -> dict[str, EcHandoffItem]:
        """The items a PD reads, where `kind` puts them. ValueError for a malformed mapping."""
        ktp = (self.sampling_params.extra_args or {}).get("kv_transfer_params")
        return handoff_items(kind, ktp, self.ec_transfer_params)

    def wire_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": self.token_ids}
        if self.request_id:
            body = {"request_id": self.request_id, **body}
        body["features"] = (self.features or Features()).model_dump()
        body["sampling_params"] = self.sampling_params.wire_dict()
        if self.ec_transfer_params is not None:
            body["ec_transfer_params"] = self.ec_transfer_params
        if self.stream:
            body["stream"] = True
            if self.stream_options is not None:
                body["stream_options"] = self.stream_options.model_dump(exclude_none=True)
        return body


def encode_request(request_id: str, items: Iterable[tuple[str, int, str]]) -> GenerateRequest:
    """A VE's body (docs/contract.md §2.2) for unique (mm_hash, length, full kwargs_b64) items:
    a synthetic prompt of zero tokens, placeholders repacked contiguously, one output token."""
    hashes, placeholders, kwargs, offset = [], [], [], 0
    for mm_hash, length, kwargs_b64 in items:
        hashes.append(mm_hash)
        placeholders.append(Placeholder(offset=offset, length=length))
        kwargs.append(kwargs_b64)
        offset += length
    return GenerateRequest(
        request_id=request_id,
        token_ids=[0] * offset,
        features=Features.of_images(hashes, placeholders, kwargs),
        sampling_params=SamplingParams(max_tokens=1),
    )


def encode_request_chunks(request_id: str, items: Sequence[tuple[str, int, bytes]]) -> list[bytes]:
    """`encode_request`'s body, serialized, as byte chunks to send one after the other: each
    item's kwargs (base64 ASCII bytes, which need no JSON escaping) is a chunk of its own,
    the caller's object itself, so a multi-megabyte item is never copied to build a body.
    Joined, the chunks are exactly `json.dumps(encode_request(...).wire_dict())` (compact)."""
    if not items:
        raise ValueError("a VE body needs at least one item")
    skeleton = encode_request(request_id, [(h, n, "") for h, n, _ in items]).wire_dict()
    text = json.dumps(skeleton, separators=(",", ":")).encode()
    # the only unescaped occurrence: a key, followed by the empty strings stood in for kwargs
    start = text.index(b'"kwargs_data":{"image":[') + len(b'"kwargs_data":{"image":[')
    empties = b",".join([b'""'] * len(items))
    if text[start : start + len(empties)] != empties:  # pragma: no cover - wire_dict's layout changed
        raise AssertionError("unexpected VE body layout")
    chunks = [text[: start + 1]]  # up to the first item's opening quote
    for i, (_, _, kwargs) in enumerate(items):
        if i:
            chunks.append(b'","')
        chunks.append(kwargs)
    chunks.append(text[start + len(empties) - 1 :])  # from the last item's closing quote
    return chunks


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort", "error"]


# A choice's `logprobs` (checked and translated by router/translate.client_logprobs): `content`
# a list of {token | token_id, logprob, bytes?, rank?, top_logprobs: [same]} or null. vLLM
# 0.24/0.29's generate route writes OpenAI's token strings (ChatCompletionLogProbs); 0.32's
# writes integer ids, its default `output_mode: tokens` (vllm 0.32.0
# entrypoints/scale_out/token_in_token_out/protocol.py GenerateLogProbs, GenerateLogProb:
# token_id, logprob, rank; serving.py `_create_tokens_logprobs` sends max(n, 1) candidates).
# Left open here so a bad entry is the PD's invalid answer (a 502 charged to it), not a
# refused body.
class GenerateChoice(_Open):
    index: int = 0
    logprobs: Any = None
    finish_reason: str | None = "stop"
    token_ids: list[int] = Field(default_factory=list)
    routed_experts: Any = None


class GenerateResponse(_Open):
    """Non-streaming answer (§2.4 VE, §3.2 PD), vLLM 0.24's fields: no usage (the router
    counts tokens itself), an id the engine picks (`server_request_id`)."""

    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM >= 0.29 (absent in 0.24: a 0.24 answer is dumped without it, sim/release.py)
    ec_transfer_params: dict[str, Any] | None = None

    def ec_locators(self) -> dict[str, EcLocator]:
        items = handoff_items(EC_LOCATOR, self.kv_transfer_params, None)
        return {h: item for h, item in items.items() if isinstance(item, EcLocator)}

    def handoff(self, kind: HandoffKind) -> dict[str, EcHandoffItem]:
        """The items a VE answered, where `kind` puts them. ValueError for a malformed mapping."""
        return handoff_items(kind, self.kv_transfer_params, self.ec_transfer_params)


class StreamChoice(_Open):
    index: int = 0
    logprobs: Any = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    routed_experts: Any = None


def server_request_id() -> str:
    """The id vLLM 0.24 gives a non-streaming answer: its own, 16 hex digits, not the caller's."""
    return secrets.token_hex(8)


def stream_request_id(caller_id: str) -> str:
    """The id on every frame of vLLM 0.24's streaming answer to request `caller_id`."""
    return f"generate-tokens-{caller_id}"


class StreamChunk(_Open):
    """One SSE `data:` frame of a streaming PD answer (§3.3)."""

    request_id: str
    choices: list[StreamChoice] = Field(default_factory=list)
    usage: Usage | None = None


class ErrorInfo(_Open):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Open):
    """vLLM ErrorResponse; the router adds a top-level `request_id` (§1.3)."""

    error: ErrorInfo
    request_id: str | None = None


# --- SSE framing: LF-only separators, one JSON document per `data:` line (§1.2, §3.3) ---


def sse_frame(payload: BaseModel | dict[str, Any], *, exclude_none: bool = False) -> bytes:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=exclude_none)
    else:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
    return b"data: " + text.encode() + b"\n\n"


def split_sse(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split complete `\\n\\n`-terminated events off a byte buffer; return (events, rest).

    Works on bytes so a multi-byte character split across network chunks is never decoded
    half-way (the reference router's hazard, docs/contract.md §1.2)."""
    *events, rest = buffer.split(b"\n\n")
    return [e for e in events if e], rest


def sse_data(event: bytes) -> bytes | None:
    """The payload of one event if it is a `data:` event, else None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].lstrip(b" ")
    return None


async def iter_sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield each `data:` payload (bytes) until `[DONE]`, from raw response chunks."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        events, buffer = split_sse(buffer)
        for event in events:
            data = sse_data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                return
            yield data


def iter_sse_payloads_sync(chunks: Iterable[bytes]) -> list[bytes]:
    """Synchronous variant for tests and tools: every payload before `[DONE]`."""
    buffer = b""
    out: list[bytes] = []
    for chunk in chunks:
        buffer += chunk
        events, buffer = split_sse(buffer)
        for event in events:
            data = sse_data(event)
            if data == b"[DONE]":
                return out
            if data is not None:
                out.append(data)
    return out
