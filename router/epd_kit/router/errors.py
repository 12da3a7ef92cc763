"""Router errors and the client-facing error envelope (docs/contract.md §1.3, with real messages).

Every failure the router can report is a `RouterError` carrying the HTTP status, the OpenAI
error `type`, a message that says what went wrong and where, and, for pushback statuses, a
Retry-After value. Anything else reaching the top is a bug and becomes a 500 with the same
envelope (routes.py).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from starlette.responses import Response

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class RouterError(Exception):
    # what the client is told instead of `message`, when that names engine internals (an
    # address, an id, an engine's own words): `message` is for the log and operators
    client_message: str | None = None

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        type_: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code  # OpenAI's error code where it has one (model_not_found); else the status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.type = type_ or TYPES.get(status, "error")

    @property
    def retryable(self) -> bool:
        return self.status in (429, 502, 503, 504)

    def envelope(self, request_id: str | None) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message if self.client_message is None else self.client_message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            },
            "request_id": request_id,
        }

    def headers(self, request_id: str | None) -> dict[str, str]:
        headers = {}
        if request_id:
            headers["x-request-id"] = request_id
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers

    def body(self, request_id: str | None) -> bytes:
        """The envelope as JSON, ASCII-escaped: a message quoting client input (a field name,
        a lone surrogate) can always be encoded."""
        return json.dumps(self.envelope(request_id), separators=(",", ":")).encode()

    def response(self, request_id: str | None) -> Response:
        return Response(
            self.body(request_id),
            status_code=self.status,
            headers=self.headers(request_id),
            media_type="application/json",
        )

    def sse_frame(self, request_id: str | None) -> bytes:
        return b"data: " + self.body(request_id) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, param=param)


class Failure(StrEnum):
    """How an engine call failed when it is the engine's fault (health.py weighs them)."""

    refused = "refused"  # nothing listens: the process is gone
    connect_timeout = "connect_timeout"  # may be our own overload as much as the engine's
    timeout = "timeout"  # accepted and did not answer in time: possibly hung
    error = "error"  # 5xx, broken connection, invalid answer


class UpstreamError(RouterError):
    """A VE/PD call failed; `failure` says how, when it counts against the engine (None:
    it does not, e.g. a 4xx about the request or 429 pushback)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        engine_id: str,
        stage: str,
        failure: Failure | None,
        retry_other: bool,
    ) -> None:
        super().__init__(status, message)
        self.engine_id = engine_id
        self.stage = stage
        self.failure = failure
        self.retry_other = retry_other

    @property
    def engine_failed(self) -> bool:
        return self.failure is not None

    # what the client is told, in a JSON error or a stream's error frame (docs/router.md
    # "Engine failures"): `message` names the engine and its address, for the log and for
    # operators; upstream.py sets a message of its own per case
    client_message: str | None = "the engine failed while generating"

    def for_client(self) -> RouterError:
        return RouterError(self.status, self.client_message or self.message)


class EcLoadFailed(UpstreamError):
    """A PD could not read an item's embedding from its VE (vLLM's `ECLoadFailure`, contract
    §7.2): the request's locators may point at blocks that are gone, so it is re-encoded
    before a retry, and the VE is charged (generation.py). Recognised once, where the PD's
    answer is parsed (upstream.py); `engine_text` is what the PD said (it may name the
    items' hashes)."""

    engine_text: str = ""


class EngineDied(UpstreamError):
    """A PD's engine core died (vLLM's `EngineDeadError`): its API server answers this
    request, every one in flight and every one that arrives until it exits with the same
    fixed message, never the cause, which only its log has (docs/contract.md §3.5). For a
    request whose blocks it was to read the cause may be them (a failed or missing read
    kills the engine core), so generation.py treats it as an `EcLoadFailed` then, unless the
    engine was already known dead when the call went out. Recognised in upstream.py;
    `engine_text` is what the PD said."""

    engine_text: str = ""


class GenerationFailed(UpstreamError):
    """vLLM's per-request generation error (wire.GENERATION_ERROR_MESSAGE): not the
    engine's fault, another PD may serve the request. Upstream vLLM >= 0.30 also answers it
    when its EC consumer could not fetch an item it had an address for (vLLM 0.32.0
    v1/core/sched/scheduler.py: the connector's take_unavailable_requests end FINISHED_ERROR,
    "Failing is retryable: re-issuing the request re-runs the encode"), so in an
    `ec_transfer_params` fleet generation.py re-encodes the request's items before the retry."""
