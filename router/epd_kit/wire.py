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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GENERATE_PATH = "/inference/v1/generate"
# the paths an engine started with an API key checks it on (never OPTIONS): vllm 0.24.0
# entrypoints/serve/utils/server_utils.py:41 GUARDED_PREFIX; 0.29.0 adds "/cohere"
# (entrypoints/serve/middleware/authenticate.py:11). docs/security.md "Engine keys".
KEY_GUARDED_PATHS = ("/v1", "/v2", "/inference")
KEY_GUARDED_PATHS_0_29 = (*KEY_GUARDED_PATHS, "/cohere")
MODALITY_IMAGE = "image"  # the reference labels every item "image" (docs/contract.md §2.2)
SSE_DONE = b"data: [DONE]\n\n"


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
        ktp = (self.extra_args or {}).get("kv_transfer_params") or {}
        raw = ktp.get("ec_locator") or {}
        return {h: EcLocator.model_validate(loc) for h, loc in raw.items()}

    def with_ec_locators(self, locators: dict[str, EcLocator]) -> SamplingParams:
        """Copy with `kv_transfer_params` replaced wholesale, client extra_args kept (§3.1)."""
        extra = dict(self.extra_args or {})
        extra["kv_transfer_params"] = {"ec_locator": {h: loc.model_dump() for h, loc in locators.items()}}
        return self.model_copy(update={"extra_args": extra})

    def wire_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class GenerateRequest(_Open):
    """Body of `POST /inference/v1/generate` on both pools."""

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    features: Features | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def wire_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": self.token_ids}
        if self.request_id:
            body = {"request_id": self.request_id, **body}
        body["features"] = (self.features or Features()).model_dump()
        body["sampling_params"] = self.sampling_params.wire_dict()
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

    def ec_locators(self) -> dict[str, EcLocator]:
        raw = (self.kv_transfer_params or {}).get("ec_locator") or {}
        return {h: EcLocator.model_validate(loc) for h, loc in raw.items()}


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
