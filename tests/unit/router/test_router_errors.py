"""Upstream failure classification (incl. the typed EC-load failure) and the error envelope
(docs/contract.md §1.3, improved)."""

import json

import pytest
from multidict import CIMultiDict

from epd_kit.router import engine_http, upstream
from epd_kit.router.errors import EcLoadFailed, Failure, RouterError, UpstreamError
from epd_kit.router.pools import Engine

VE = Engine(id="epd-ve-1", url="http://127.0.0.1:18301", role="ve")
PD = Engine(id="epd-pd-0", url="http://127.0.0.1:18100", role="pd")


def response(status, body=b"", headers=None):
    return upstream.EngineAnswer(status, body, CIMultiDict(headers or {}))


REFUSED = engine_http.CannotConnect(111, "Cannot connect to host 127.0.0.1:18301 [Connection refused]")


@pytest.mark.parametrize(
    ("exc", "status", "failure", "retry"),
    [
        (REFUSED, 502, Failure.refused, True),
        (engine_http.ConnectTimeout("slow"), 502, Failure.connect_timeout, True),
        (engine_http.ReadTimeout("slow"), 504, Failure.timeout, True),
        (engine_http.ClosedBeforeAnswer(), 502, Failure.error, True),
        (engine_http.AnswerCutShort("cut short"), 502, Failure.error, True),
        (engine_http.ConnectionBroken(104, "reset"), 502, Failure.error, True),
    ],
)
def test_exceptions(exc, status, failure, retry):
    err = upstream.classify_exception(exc, VE)
    assert (err.status, err.failure, err.retry_other) == (status, failure, retry)
    assert err.engine_failed == (failure is not None)
    assert "encode on VE epd-ve-1 (http://127.0.0.1:18301)" in err.message
    assert err.engine_id == "epd-ve-1" and err.stage == "encode"


def test_5xx_counts_against_engine_and_is_retried():
    err = upstream.classify_status(response(503, b'{"detail":"engine dead"}'), PD)
    assert err.status == 502 and err.engine_failed and err.retry_other
    assert "generate on PD epd-pd-0" in err.message and "HTTP 503: engine dead" in err.message


def test_4xx_never_counts_and_is_not_retried():
    body = b'{"error":{"message":"image produces 5000 embedding tokens","type":"BadRequest","code":400}}'
    err = upstream.classify_status(response(400, body), VE)
    assert err.status == 400 and not err.engine_failed and not err.retry_other
    assert "rejected the request: HTTP 400: image produces 5000 embedding tokens" in err.message


def test_other_4xx_is_an_upstream_failure_not_counted():
    err = upstream.classify_status(response(404, b'{"detail":"Not Found"}'), PD)
    assert err.status == 502 and not err.engine_failed and not err.retry_other
    assert "HTTP 404: Not Found" in err.message


def test_429_is_pushback():
    err = upstream.classify_status(response(429, b"", {"retry-after": "7"}), PD)
    assert err.status == 429 and not err.engine_failed and err.retry_other
    assert err.retry_after == 7


def test_a_missed_deadline_is_a_timeout_failure():
    err = upstream.deadline_exceeded(VE, 12.5, "2 items, 512 tokens in flight")
    assert (err.status, err.failure, err.retry_other) == (504, Failure.timeout, True)
    assert "no answer within 12.5s (2 items, 512 tokens in flight)" in err.message


def test_missing_locator_is_a_failure():
    body = b'{"request_id":"x","choices":[{"index":0,"token_ids":[0]}],"kv_transfer_params":{"ec_locator":{}}}'
    with pytest.raises(RouterError) as info:
        upstream.parse_ve_response(response(200, body), VE, ["abcdef0123456789ff"])
    assert info.value.status == 502 and "no EC locator for 1 item" in info.value.message


UPSTREAM = {
    "item_indices": [0],
    "metadata": {},
    "peer_host": "10.0.0.1",
    "peer_port": 5600,
    "size_bytes": 8,
    "shape": [1, 2],
}


@pytest.mark.parametrize(
    "entries",
    [
        {},  # no entry for the item
        {"abcdef0123456789ff": {"item_indices": [0], "metadata": {}}},  # the producer no longer held it
        {"abcdef0123456789ff": {k: v for k, v in UPSTREAM.items() if k != "peer_host"}},
    ],
)
def test_an_upstream_answer_without_a_fetchable_entry_is_the_ves_failure(entries):
    """Sent on, the PD would encode the item itself from LM-only kwargs and its engine core would
    die: the VE is charged (Failure.error) and the item moves to another VE (retry_other)."""
    doc = {"request_id": "x", "choices": [{"index": 0, "token_ids": []}], "kv_transfer_params": None}
    body = json.dumps({**doc, "ec_transfer_params": entries}).encode()
    with pytest.raises(UpstreamError) as info:
        upstream.parse_ve_response(response(200, body), VE, ["abcdef0123456789ff"], "ec_transfer_params")
    err = info.value
    assert (err.status, err.failure, err.retry_other, err.engine_id) == (502, Failure.error, True, "epd-ve-1")
    assert "no ec_transfer_params entry with a producer address for 1 item" in err.message


def test_each_handoff_reads_only_its_own_place():
    """A fleet's VE answer is read in the fleet's hand-off: an ec_locator answer to a router set for
    ec_transfer_params (or the reverse) has nothing to read, a VE failure, not a PD's death."""
    entry = {"h": UPSTREAM}
    upstream_body = json.dumps({"request_id": "x", "choices": [], "ec_transfer_params": entry}).encode()
    got = upstream.parse_ve_response(response(200, upstream_body), VE, ["h"], "ec_transfer_params")
    assert got["h"].model_dump(exclude_unset=True) == UPSTREAM
    with pytest.raises(UpstreamError, match="no EC locator"):
        upstream.parse_ve_response(response(200, upstream_body), VE, ["h"], "ec_locator")
    loc = {"engine_id": "e", "host": "h", "port": 1, "remote_block_ids": [1], "num_tokens": 1}
    neuron_body = json.dumps({"request_id": "x", "choices": [], "kv_transfer_params": {"ec_locator": {"h": loc}}})
    with pytest.raises(UpstreamError, match="no ec_transfer_params entry"):
        upstream.parse_ve_response(response(200, neuron_body.encode()), VE, ["h"], "ec_transfer_params")


def test_envelope_shape_and_headers():
    err = RouterError(503, "not ready: no healthy active PD", retry_after=2.2)
    env = err.envelope("rid-1")
    assert env == {
        "error": {
            "message": "not ready: no healthy active PD",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        },
        "request_id": "rid-1",
    }
    assert err.headers("rid-1") == {"x-request-id": "rid-1", "Retry-After": "2"}
    frame = err.sse_frame("rid-1")
    assert frame.startswith(b"data: {") and frame.endswith(b"\n\n")


EC_LOAD = b'{"error":{"message":"ECLoadFailure: Encoder-cache load failed for mm_hashes: [\'ab12\']","code":500}}'


def test_a_pd_ec_load_failure_is_typed_once_at_the_boundary():
    err = upstream.classify_status(response(500, EC_LOAD), PD)
    assert isinstance(err, EcLoadFailed)
    assert err.status == 502 and err.engine_failed and err.retry_other
    assert "Encoder-cache load failed" in err.message
    # same words from a VE, or another PD failure: not an EC-load failure
    assert not isinstance(upstream.classify_status(response(500, EC_LOAD), VE), EcLoadFailed)
    assert not isinstance(upstream.classify_status(response(500, b'{"detail":"engine dead"}'), PD), EcLoadFailed)
    assert not isinstance(upstream.classify_exception(engine_http.ConnectionBroken(104, "reset"), PD), EcLoadFailed)


def test_stream_error_frames_are_classified():
    ec = upstream.classify_stream_error(EC_LOAD, PD)
    assert isinstance(ec, EcLoadFailed) and ec.status == 502 and ec.engine_failed and ec.retry_other
    assert "failed before the first token: ECLoadFailure" in ec.message
    refused = upstream.classify_stream_error(b'{"error":{"message":"prompt too long","code":400}}', PD)
    assert type(refused) is UpstreamError and not refused.engine_failed and not refused.retry_other
    assert refused.status == 400 and "prompt too long" in refused.client_message
    # a 4xx the router cannot blame on the body (router and engine disagree): still a 502
    odd = upstream.classify_stream_error(b'{"error":{"message":"no such route","code":404}}', PD)
    assert odd is not None and odd.status == 502 and not odd.engine_failed
    bare = upstream.classify_stream_error(b'{"error":"boom"}', PD)
    assert bare is not None and bare.engine_failed and "boom" in bare.message
    assert upstream.classify_stream_error(b'{"request_id":"r","choices":[{"token_ids":[1]}]}', PD) is None
    assert upstream.classify_stream_error(b"not json", PD) is None


def _every_upstream_error() -> list[UpstreamError]:
    """One error of each kind upstream.py makes, for both engine roles."""
    errors: list[UpstreamError] = []
    for engine in (VE, PD):
        errors += [
            upstream.classify_exception(REFUSED, engine),
            upstream.classify_exception(engine_http.ConnectTimeout("slow"), engine),
            upstream.classify_exception(engine_http.ReadTimeout("slow"), engine),
            upstream.classify_exception(engine_http.AnswerTooLarge("the engine's answer is too long"), engine),
            upstream.classify_exception(engine_http.ClosedBeforeAnswer(), engine),
            upstream.deadline_exceeded(engine, 3.0, "2 items"),
            upstream.classify_status(response(500, b'{"error":{"message":"dead at 10.0.0.9:18100"}}'), engine),
            upstream.classify_status(response(429, b'{"error":{"message":"busy"}}'), engine),
            upstream.classify_status(response(404, b'{"detail":"no route"}'), engine),
            upstream.bad_body(engine, "logprobs have logprob nan"),
        ]
    errors += [
        upstream.classify_stream_error(EC_LOAD, PD),
        upstream.classify_stream_error(b'{"error":{"message":"engine core 10.0.0.9 died","code":500}}', PD),
        upstream.stream_stalled(PD, 30),
        upstream.stream_truncated(PD, True),
        upstream.stream_error_frame(PD, "failed at 10.0.0.9:18100"),
        upstream.blocks_unreadable(VE, PD.id),
    ]
    return errors


@pytest.mark.parametrize("err", _every_upstream_error(), ids=lambda e: e.message[:60])
def test_a_client_is_told_no_engine_internals(err):
    """The JSON errors (not only the stream frames, 841a358) named the engine, its
    address and what it said about itself; the log keeps them (`message`), the client's
    envelope says what happened, with its request id."""
    assert err.engine_id in err.message  # for the log and /pools
    for body in (err.body("rid-1"), err.sse_frame("rid-1")):
        doc = json.loads(body.removeprefix(b"data: "))
        assert doc["request_id"] == "rid-1" and doc["error"]["code"] == err.status
        message = doc["error"]["message"]
        assert message and message != err.message
        for internal in ("127.0.0.1", "18301", "18100", "10.0.0.9", "epd-ve-1", "epd-pd-0", "mm_hashes", "nan"):
            assert internal not in message, message


def test_a_request_the_engine_refused_keeps_what_it_said_about_it():
    said = b'{"error":{"message":"This model\'s maximum context length is 8192 tokens."}}'
    err = upstream.classify_status(response(400, said), PD)
    assert err.status == 400 and not err.engine_failed
    message = json.loads(err.body("r"))["error"]["message"]
    assert (
        message
        == "the engine rejected the request (generate, HTTP 400): This model's maximum context length is 8192 tokens."
    )
    refused = upstream.classify_stream_error(b'{"error":{"message":"prompt too long","code":400}}', PD)
    assert json.loads(refused.body("r"))["error"]["message"] == "the engine rejected the request: prompt too long"
