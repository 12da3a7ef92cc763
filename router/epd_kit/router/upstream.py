"""How the router reads the engines' answers: responses, and failures classified into client
statuses, engine-health signals and typed errors (no I/O here: engine_client.py does the calls;
the request bodies are bodies.py's).

Rules (docs/contract.md §1.3): connect errors, timeouts (incl. a call's own deadline), broken
connections and 5xx count against the engine, each as a `Failure` kind that health.py weighs;
a 4xx never does (it is about the request); 429 is pushback: try elsewhere, do not mark the
engine down; vLLM's per-request generation error (`generation_failed`) is a 502 that does
not count either: the engine is fine, this one request failed on it.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epd_kit.router import engine_http
from epd_kit.router.errors import EcLoadFailed, EngineDied, Failure, GenerationFailed, UpstreamError
from epd_kit.router.pools import Engine
from epd_kit.wire import (
    EC_BLOCK_LEN_MISMATCH,
    EC_LOCATOR,
    ENGINE_DEAD_MESSAGE,
    GENERATION_ERROR_MESSAGE,
    EcHandoffItem,
    GenerateResponse,
    HandoffKind,
    unreadable_items,
)

STAGE_NAMES = {"ve": "encode", "pd": "generate"}

# How a PD says it could not read an embedding from a VE (vLLM's ECLoadFailure, contract
# §7.2), or could not take its blocks at all (the handshake's "EC region block_len mismatch",
# §3.5: VE and PD disagree on the block geometry; the PD's engine core dies as on a failed
# read, so the same blocks must go to no other PD). Engines report it only as text; this is
# the one place that text is read.
EC_LOAD_FAILURE_MARKERS = ("ECLoadFailure", "Encoder-cache load", "ec_locator", EC_BLOCK_LEN_MISMATCH)

# What vLLM's API server answers once its engine core has died, whatever killed it
# (vllm/v1/engine/exceptions.py EngineDeadError, 0.24.0 and 0.29.0): the failed request, every
# one in flight and every one that arrives before the server exits (entrypoints/launcher.py
# terminate_if_errored) get it, as a 500 {"error": {"message": this, "type":
# "InternalServerError", "code": 500}} or, in a stream, as that error event and [DONE]. The
# cause (an ECLoadFailure, a missing embedding, anything else) stays in the engine's log: the
# engine core is another process, and the API server only learns that it died. So a real PD
# never sends EC_LOAD_FAILURE_MARKERS; this message (wire.ENGINE_DEAD_MESSAGE) is how its failed
# read reaches the router (docs/contract.md §3.5, docs/router.md "Failure outcomes").

# How vLLM says generation failed for one request: a choice finished with reason "error", a
# "retryable request-level internal error (e.g., KV load failure)" (vllm/v1/engine/__init__.py
# FinishReason). `_raise_if_error` turns it into GenerationError("Internal server error"),
# answered as {"error": {"message": "Internal server error", "type": "InternalServerError",
# "param": null, "code": 500}}: in a stream as its last event before [DONE] (both releases),
# else as the route's 500 in 0.29.0 (entrypoints/scale_out/token_in_token_out/serving.py:305)
# and as a 200 with that choice in 0.24.0 (entrypoints/serve/disagg/serving.py:292 does not
# check it). An engine-wide failure (EngineDeadError, EngineGenerateError, any other
# exception) has the same type and code with another message, so the message tells them
# apart. The router reads every shape whatever the fleet's release: during a release change
# PDs of both serve side by side. docs/compat.md "Generation errors" has the file:lines; the
# message is wire.GENERATION_ERROR_MESSAGE.
GENERATION_ERROR_FINISH = "error"


@dataclass(frozen=True)
class EngineAnswer:
    """A complete engine answer, as engine_client.py read it off the wire."""

    status: int
    body: bytes
    headers: Mapping[str, str]


def _engine_message(answer: EngineAnswer) -> str:
    """A short, single-line excerpt of an engine's error body (never request data)."""
    try:
        doc = json.loads(answer.body[:4096] or b"null")
    except ValueError:
        text = answer.body[:200].decode("utf-8", "replace")
    else:
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict):
                text = str(err.get("message", ""))
            else:
                text = str(doc.get("detail", "") or doc.get("message", "") or err or "")
        else:
            text = ""
    return " ".join(text.split())[:200]


def _failure(
    engine: Engine,
    status: int,
    message: str,
    engine_text: str = "",
    *,
    failure: Failure | None,
    retry_other: bool,
    client: str | None = None,
    error_type: type[UpstreamError] = UpstreamError,
) -> UpstreamError:
    """The typed error for a failed engine call; `engine_text` is what the engine said.
    `message` (with `where`) is for the log and /pools; `client` is what the client is told,
    without engine internals (no address, no id), else UpstreamError's default."""
    if engine.role == "pd" and any(m in engine_text for m in EC_LOAD_FAILURE_MARKERS):
        error_type = EcLoadFailed
    elif engine.role == "pd" and ENGINE_DEAD_MESSAGE in engine_text:
        error_type = EngineDied
    err = error_type(
        status, message, engine_id=engine.id, stage=STAGE_NAMES[engine.role], failure=failure, retry_other=retry_other
    )
    if isinstance(err, EcLoadFailed | EngineDied):
        err.engine_text = engine_text
    if client is not None:
        err.client_message = client
    return err


def where(engine: Engine) -> str:
    return f"{STAGE_NAMES[engine.role]} on {engine.role.upper()} {engine.id} ({engine.url})"


def classify_exception(exc: engine_http.EngineCallError, engine: Engine) -> UpstreamError:
    """An engine call that raised (engine_http.py's exception types; the pool is unbounded, so
    no wait for a connection of our own). The type's name goes into the log's message only."""
    kind = type(exc).__name__
    stage = STAGE_NAMES[engine.role]
    if isinstance(exc, engine_http.ConnectTimeout):
        message = f"{where(engine)} failed: cannot connect ({kind})"
        client = f"cannot connect to the engine ({stage})"
        return _failure(engine, 502, message, failure=Failure.connect_timeout, retry_other=True, client=client)
    if isinstance(exc, engine_http.CannotConnect):
        message = f"{where(engine)} failed: cannot connect ({kind})"
        client = f"cannot connect to the engine ({stage})"
        return _failure(engine, 502, message, failure=Failure.refused, retry_other=True, client=client)
    if isinstance(exc, engine_http.EngineTimeout):
        message = f"{where(engine)} timed out ({kind})"
        client = f"the engine timed out ({stage})"
        return _failure(engine, 504, message, failure=Failure.timeout, retry_other=True, client=client)
    if isinstance(exc, engine_http.AnswerTooLarge):  # a size cap refused the answer: the connection was fine
        message = f"{where(engine)} failed: {str(exc) or 'its answer is too large'} ({kind})"
        client = "the engine's answer was too large"
        return _failure(engine, 502, message, failure=Failure.error, retry_other=True, client=client)
    message = f"{where(engine)} failed: connection broken ({kind})"
    client = "the connection to the engine broke"
    return _failure(engine, 502, message, failure=Failure.error, retry_other=True, client=client)


def deadline_exceeded(engine: Engine, deadline_s: float, what: str) -> UpstreamError:
    """A call that outlived the deadline derived from its work (deadlines.py): the engine
    accepted it and did not answer in time, which is how a hung engine looks."""
    message = f"{where(engine)} timed out: no answer within {deadline_s:.1f}s ({what})"
    client = f"the engine did not answer within {deadline_s:.1f}s ({STAGE_NAMES[engine.role]})"
    return _failure(engine, 504, message, failure=Failure.timeout, retry_other=True, client=client)


def stream_stalled(engine: Engine, gap_s: float) -> UpstreamError:
    """A started stream that sent no token for `gap_s`: the engine took the request and
    stopped generating (it may still send events without tokens), which is how a PD that
    hangs mid-stream looks."""
    message = f"{where(engine)} timed out: no token in the stream for {gap_s:g}s (timeouts.stream_gap_s)"
    client = f"generation stalled: no token for {gap_s:g}s"
    return _failure(engine, 504, message, failure=Failure.timeout, retry_other=False, client=client)


def stream_truncated(engine: Engine, done: bool) -> UpstreamError:
    """A started stream that ended before every choice had its finish_reason."""
    how = "[DONE] before a finish_reason" if done else "neither a finish_reason nor [DONE]"
    message = f"{where(engine)} failed: the stream ended with {how}"
    client = "the stream from the engine ended before the answer was complete"
    return _failure(engine, 502, message, failure=Failure.error, retry_other=False, client=client)


def generation_failed(engine: Engine, how: str, *, retry_other: bool = True) -> UpstreamError:
    """vLLM's per-request generation error (GENERATION_ERROR_MESSAGE): a 502 that is not
    charged to the engine; another engine may still serve the request (vLLM calls it
    retryable), while the client has nothing yet."""
    stage = STAGE_NAMES[engine.role]
    message = f"{where(engine)} failed this request: vLLM generation error ({how}); not counted against the engine"
    client = f"the engine could not complete this request ({stage}: vLLM generation error)"
    return _failure(
        engine, 502, message, failure=None, retry_other=retry_other, client=client, error_type=GenerationFailed
    )


def _is_generation_error(error: object) -> bool:
    """An `error` object of vLLM's ErrorResponse that is GenerationError's (code 500 when given)."""
    return (
        isinstance(error, dict) and error.get("message") == GENERATION_ERROR_MESSAGE and error.get("code", 500) == 500
    )


def _error_object(body: bytes) -> object:
    try:
        doc = json.loads(body[:4096] or b"null")
    except ValueError:
        return None
    return doc.get("error") if isinstance(doc, dict) else None


def stream_error_frame(engine: Engine, said: str) -> UpstreamError:
    """A started stream in which the PD sent an error frame (`said`: its message)."""
    if _is_generation_error({"message": said}):  # the relay keeps the event's message only
        return generation_failed(engine, "error event mid-stream", retry_other=False)
    message = f"{where(engine)} failed mid-stream: {said}"
    return _failure(engine, 502, message, said, failure=Failure.error, retry_other=False)


# an engine's statuses for a body it refuses (vLLM's validation errors): the client's to fix
CLIENT_FAULT_CODES = (400, 413, 422)


def classify_status(answer: EngineAnswer, engine: Engine) -> UpstreamError:
    code = answer.status
    said = _engine_message(answer)
    detail = f": {said}" if said else ""
    stage = STAGE_NAMES[engine.role]
    if code == 429:
        message = f"{where(engine)} is overloaded (HTTP 429){detail}"
        client = f"the engine is overloaded ({stage}, HTTP 429)"
        err = _failure(engine, 429, message, said, failure=None, retry_other=True, client=client)
        err.retry_after = _retry_after(answer)
        return err
    if code == 500 and _is_generation_error(_error_object(answer.body)):
        return generation_failed(engine, "HTTP 500")
    if code >= 500:  # what the engine said stays in the log: it may name its internals
        message = f"{where(engine)} failed: HTTP {code}{detail}"
        client = f"the engine failed ({stage}, HTTP {code})"
        return _failure(engine, 502, message, said, failure=Failure.error, retry_other=True, client=client)
    if code == 401:
        # the engine's key check (vLLM's --api-key / VLLM_API_KEY) refused every key the router
        # has: the engine is healthy, the router's engine_auth.key_file is not what it was
        # started with. Not charged (an ejection would only loop: /health, unchecked, readmits
        # it); another engine may hold the router's key (a rotation half done), so the request
        # may move
        message = (
            f"{where(engine)} refused the router's engine key (HTTP 401): engine_auth.key_file does "
            "not hold the key this engine was started with (VLLM_API_KEY); docs/security.md 'Engine keys'"
        )
        client = f"the router could not authenticate to the engine ({stage})"
        return _failure(engine, 502, message, failure=None, retry_other=True, client=client)
    # 400/413/422: the engine refused this request's content (e.g. too many tokens for the
    # context, an image too big for the compiled encoder): the client's to fix, so a 400 with
    # what the engine said about it. Other 4xx (404, 401, ...) mean the router and engine
    # disagree: an upstream failure, the client gets no detail.
    if code in CLIENT_FAULT_CODES:
        status, client = 400, f"the engine rejected the request ({stage}, HTTP {code}){detail}"
    else:
        status, client = 502, f"the engine rejected the request ({stage}, HTTP {code})"
    message = f"{where(engine)} rejected the request: HTTP {code}{detail}"
    return _failure(engine, status, message, said, failure=None, retry_other=False, client=client)


def classify_stream_error(payload: bytes, engine: Engine) -> UpstreamError | None:
    """The error a PD stream's payload reports (JSON with `error` and no `choices`), if any.
    Used on the first payload, before the client has a byte: the request may still move."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    if not (isinstance(doc, dict) and doc.get("error") and not doc.get("choices")):
        return None
    if _is_generation_error(doc["error"]):
        return generation_failed(engine, "error event before the first token")
    err = doc["error"] if isinstance(doc["error"], dict) else {"message": str(doc["error"])}
    code = err.get("code") if isinstance(err.get("code"), int) else 500
    engine_failed = not 400 <= code < 500  # a 4xx frame is about the request
    said = str(err.get("message"))[:200]
    message = f"{where(engine)} failed before the first token: {said}"
    failure = Failure.error if engine_failed else None
    client = "the engine failed before the first token" if engine_failed else f"the engine rejected the request: {said}"
    # vLLM streams a request its input processor refuses (a prompt past --max-model-len) as a
    # 200 whose one event is {"error": {..., "type": "BadRequestError", "code": 400}} (its
    # generate route's stream, vllm/entrypoints/serve/disagg/serving.py): the same refusal as
    # the non-stream 400, so the same client status (classify_status)
    status = 400 if code in CLIENT_FAULT_CODES else 502
    return _failure(engine, status, message, said, failure=failure, retry_other=engine_failed, client=client)


# The longest Retry-After handed on from an engine: it is advice for this router's client,
# and the router's own waits (placement.queue_timeout_s) are of this order.
MAX_RETRY_AFTER_S = 60.0


def _retry_after(answer: EngineAnswer) -> float:
    """An engine 429's `Retry-After` (RFC 9110 10.2.3: delay-seconds or an HTTP-date), as
    seconds in [1, MAX_RETRY_AFTER_S]; anything else (inf, nan, negative, garbage) is 1."""
    text = answer.headers.get("retry-after", "").strip()
    if text.isascii() and text.isdigit():  # delay-seconds is 1*DIGIT: no sign, exponent, inf, nan
        seconds = float(min(int(text[:6]), 999_999))
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
            seconds = (when - datetime.datetime.now(datetime.UTC)).total_seconds()
        except (TypeError, ValueError, IndexError, OverflowError):  # not a date either
            seconds = 1.0
    return min(max(seconds, 1.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else 1.0


def blocks_unreadable(ve: Engine, pd_id: str, *, engine_died: bool = False) -> UpstreamError:
    """What a VE is charged with when a PD could not read its blocks (an `EcLoadFailed`
    from that PD, or its `EngineDied` on a request with blocks to read): the producer's
    failure, since a PD engine core that fails a read dies (docs/contract.md §3.5) and a VE
    whose side channel refuses reads would kill every PD."""
    if engine_died:
        message = f"PD {pd_id}'s engine core died (EngineDeadError) with the blocks of VE {ve.id} to read"
    else:
        message = f"PD {pd_id} could not read the blocks of VE {ve.id} (ECLoadFailure)"
    client = "an engine could not read the image embeddings"
    return _failure(ve, 502, message, failure=Failure.error, retry_other=True, client=client)


def bad_body(engine: Engine, what: str) -> UpstreamError:
    message = f"{where(engine)} returned an invalid response: {what}"
    client = "the engine sent an invalid answer"
    return _failure(engine, 502, message, failure=Failure.error, retry_other=True, client=client)


def _check_finished(body: GenerateResponse, engine: Engine) -> None:
    """vLLM 0.24's non-streaming answer to a failed generation: 200 with a choice whose
    finish_reason is "error" (0.29 answers the 500 above instead)."""
    if any(choice.finish_reason == GENERATION_ERROR_FINISH for choice in body.choices):
        raise generation_failed(engine, 'HTTP 200 with finish_reason "error"')


def parse_ve_response(
    answer: EngineAnswer, engine: Engine, hashes: Sequence[str], handoff: HandoffKind = EC_LOCATOR
) -> dict[str, EcHandoffItem]:
    """The hand-off of every item in `hashes`, read in the fleet's kind (`handoff`). An answer
    without a readable entry for an item is the VE's failure (bad_body: charged, the items
    encoded on the next VE, encode.py): sent on, the PD would encode the item itself from the
    LM-only kwargs and its engine core would die (docs/contract.md "Hand-offs")."""
    try:
        body = GenerateResponse.model_validate_json(answer.body)
        _check_finished(body, engine)  # a failed generation has no locators to read (an UpstreamError)
        items = body.handoff(handoff)
    except ValueError as exc:
        raise bad_body(engine, f"not a GenerateResponse with valid {handoff} ({exc.__class__.__name__})") from None
    missing = unreadable_items(items, hashes)
    if missing:
        what = "EC locator" if handoff == EC_LOCATOR else "ec_transfer_params entry with a producer address"
        raise bad_body(engine, f"no {what} for {len(missing)} item(s), e.g. {missing[0][:16]}")
    return {h: items[h] for h in hashes}


def parse_pd_response(answer: EngineAnswer, engine: Engine) -> GenerateResponse:
    try:
        body = GenerateResponse.model_validate_json(answer.body)
    except ValueError as exc:
        raise bad_body(engine, f"not a GenerateResponse ({exc.__class__.__name__})") from None
    _check_finished(body, engine)
    return body
