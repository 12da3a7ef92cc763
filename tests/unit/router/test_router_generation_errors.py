"""vLLM's per-request generation error (a choice finished with reason "error") against an
engine-wide failure: the first is a 502 for the client that does not count against the engine,
in each shape vLLM sends it (docs/compat.md "Generation errors"); the second still counts."""

import json

import pytest
from multidict import CIMultiDict

from epd_kit.router import upstream
from epd_kit.router.errors import GenerationFailed, UpstreamError
from epd_kit.router.pools import Engine

VE = Engine(id="epd-ve-1", url="http://127.0.0.1:18301", role="ve")
PD = Engine(id="epd-pd-0", url="http://127.0.0.1:18100", role="pd")

# GenerationError through create_error_response, 0.24.0 and 0.29.0 alike
GENERATION_ERROR = (
    b'{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}'
)
# EngineDeadError (v1/engine/exceptions.py), EngineGenerateError (no message), Starlette's own 500
ENGINE_DEAD = (
    b'{"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", '
    b'"type": "InternalServerError", "param": null, "code": 500}}'
)
ENGINE_GENERATE = b'{"error": {"message": "", "type": "InternalServerError", "param": null, "code": 500}}'
SERVER_ERROR = b"Internal Server Error"


def answer(status: int, body: bytes) -> upstream.EngineAnswer:
    return upstream.EngineAnswer(status, body, CIMultiDict())


def _is_generation_error(err: UpstreamError) -> None:
    assert err.status == 502 and not err.engine_failed
    assert "vLLM generation error" in err.message and "not counted against the engine" in err.message
    client = json.loads(err.body("r"))["error"]["message"]
    assert client.startswith("the engine could not complete this request") and "127.0.0.1" not in client


@pytest.mark.parametrize("engine", [PD, VE], ids=["pd", "ve"])
def test_0_29s_500_is_a_generation_error_retried_elsewhere(engine):
    err = upstream.classify_status(answer(500, GENERATION_ERROR), engine)
    _is_generation_error(err)
    assert err.retry_other and type(err) is GenerationFailed  # not a failed read (EcLoadFailed, EngineDied)


@pytest.mark.parametrize("body", [ENGINE_DEAD, ENGINE_GENERATE, SERVER_ERROR], ids=["dead", "generate", "starlette"])
def test_an_engine_wide_500_still_counts(body):
    err = upstream.classify_status(answer(500, body), PD)
    assert err.status == 502 and err.engine_failed and err.retry_other


def test_only_a_500_with_that_body_is_one():
    assert upstream.classify_status(answer(503, GENERATION_ERROR), PD).engine_failed
    other_code = GENERATION_ERROR.replace(b'"code": 500', b'"code": 503')
    assert upstream.classify_status(answer(500, other_code), PD).engine_failed


def _choice(finish: str) -> bytes:
    return json.dumps(
        {"request_id": "r", "choices": [{"index": 0, "finish_reason": finish, "token_ids": [1, 2]}]}
    ).encode()


def test_0_24s_200_with_an_error_choice_is_a_generation_error():
    with pytest.raises(UpstreamError) as info:
        upstream.parse_pd_response(answer(200, _choice("error")), PD)
    _is_generation_error(info.value)
    assert info.value.retry_other
    with pytest.raises(UpstreamError) as info:
        upstream.parse_ve_response(answer(200, _choice("error")), VE, ["ab" * 16])
    _is_generation_error(info.value)
    assert upstream.parse_pd_response(answer(200, _choice("length")), PD).choices[0].token_ids == [1, 2]


def test_a_streams_generation_error_event():
    payload = GENERATION_ERROR  # the same body, as a stream's `data:` event (both releases)
    first = upstream.classify_stream_error(payload, PD)
    assert first is not None
    _is_generation_error(first)
    assert first.retry_other  # before the first token: the request may still move
    mid = upstream.stream_error_frame(PD, "Internal server error")  # translate.py passes the message
    _is_generation_error(mid)
    assert not mid.retry_other
    dead = upstream.classify_stream_error(ENGINE_DEAD, PD)
    assert dead is not None and dead.engine_failed
    assert upstream.stream_error_frame(PD, "EngineCore encountered an issue.").engine_failed
