"""PD answers -> OpenAI bodies: the completion body and the stream's chunk frames; token ids
outside the vocabulary are the PD's invalid answer, and a PD's usage reaches the client only
as non-negative integers that add up."""

from __future__ import annotations

import json

import pytest

from epd_kit.router.config import parse_config
from epd_kit.router.context import RequestContext
from epd_kit.router.errors import Failure, UpstreamError
from epd_kit.router.openai_api import parse_request
from epd_kit.router.pools import Engine
from epd_kit.router.translate import StreamTranslator, client_logprobs, completion
from epd_kit.wire import GenerateResponse

PD = Engine(id="epd-pd-0", url="http://127.0.0.1:2", role="pd")


def context(config, **request) -> RequestContext:
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], **request})
    ctx = RequestContext.start(chat, "rid", parse_config(config()))
    ctx.token_ids = [1, 2, 3, 4]
    return ctx


def payload(**doc) -> bytes:
    return json.dumps({"request_id": "rid", **doc}).encode()


def frame_doc(frame: bytes) -> dict:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    return json.loads(frame[6:])


def test_completion_body(config, char_renderer):
    ctx = context(config)
    result = GenerateResponse.model_validate(
        {"request_id": "rid", "choices": [{"index": 0, "token_ids": [72, 105], "finish_reason": None}]}
    )
    body = completion(ctx, result, char_renderer(), PD)
    assert body["id"] == "chatcmpl-rid" and body["object"] == "chat.completion" and body["model"] == "/m"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop", "token_ids": [72, 105]}
    ]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_stream_chunks_without_usage(config, char_renderer):
    tr = StreamTranslator(context(config, stream=True), char_renderer(), PD)
    first = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [72]}])))
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-rid"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "H"}, "finish_reason": None}]
    assert "usage" not in first  # OpenAI: no usage key unless the client asked
    last = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [105], "finish_reason": "stop"}])))
    assert last["choices"] == [{"index": 0, "delta": {"content": "i"}, "finish_reason": "stop"}]
    assert tr.translate(payload(usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6})) is None
    assert tr.closing_usage() is None


def test_stream_usage_only_when_asked_from_the_pd_or_our_count(config, char_renderer):
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    tr = StreamTranslator(context(config, **asked), char_renderer(), PD)
    chunk = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105]}])))
    assert chunk["usage"] is None  # present on every chunk, null but on the usage chunk
    pd_usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    usage = frame_doc(tr.translate(payload(usage=pd_usage)))
    assert usage["choices"] == [] and usage["usage"] == pd_usage
    assert tr.closing_usage() is None  # already sent

    tr = StreamTranslator(context(config, **asked), char_renderer(), PD)
    tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105, 33]}]))
    ours = frame_doc(tr.closing_usage())
    assert ours["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_stream_choices_are_detokenized_apart(config, char_renderer):
    tr = StreamTranslator(context(config, stream=True, n=2), char_renderer(), PD)
    doc = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [65]}, {"index": 1, "token_ids": [66]}])))
    assert [c["delta"] for c in doc["choices"]] == [
        {"role": "assistant", "content": "A"},
        {"role": "assistant", "content": "B"},
    ]
    doc = frame_doc(tr.translate(payload(choices=[{"index": 1, "token_ids": [67]}])))
    assert doc["choices"] == [{"index": 1, "delta": {"content": "C"}, "finish_reason": None}]
    assert tr.completion_tokens == 3


def test_pd_error_frames_are_reported_not_relayed_and_junk_is_counted(config, char_renderer):
    """A PD error frame was relayed verbatim (an engine address among its fields);
    the relay now writes the router's own frame from `engine_error`."""
    tr = StreamTranslator(context(config, stream=True), char_renderer(), PD)
    error = b'{"error":{"message":"boom\\nat 10.0.0.7","type":"InternalServerError","code":500,"addr":"10.0.0.7"}}'
    assert tr.translate(error) is None and tr.engine_error == "boom at 10.0.0.7"
    assert tr.translate(b"{not json") is None
    assert tr.translate(b"[1, 2]") is None
    assert tr.translate(payload(choices=[{"index": "0", "token_ids": [1]}])) is None
    assert tr.translate(payload(choices=[{"index": 0, "token_ids": "12"}])) is None
    assert tr.translate(payload(choices=[{"index": 0, "token_ids": [1], "finish_reason": 5}])) is None
    assert tr.malformed == 5 and tr.progress == 0 and not tr.complete
    assert tr.translate(payload(choices=[])) is None
    assert tr.malformed == 5


def strict_json(frame: bytes) -> dict:
    """A frame's JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    return json.loads(frame[6:], parse_constant=refuse)


@pytest.mark.parametrize(
    "pd_usage",
    [
        b'{"prompt_tokens": NaN, "completion_tokens": 2, "total_tokens": 6}',
        b'{"prompt_tokens": 4, "completion_tokens": Infinity, "total_tokens": 6}',
        b'{"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": -Infinity}',
        b'{"prompt_tokens": -4, "completion_tokens": 2, "total_tokens": -2}',
        b'{"prompt_tokens": 4.0, "completion_tokens": 2, "total_tokens": 6}',
        b'{"prompt_tokens": "4", "completion_tokens": 2, "total_tokens": 6}',
        b'{"prompt_tokens": true, "completion_tokens": 2, "total_tokens": 3}',
        b'{"prompt_tokens": 4, "completion_tokens": 2}',
        b'{"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 99}',
        b'{"prompt_tokens": 1e400, "completion_tokens": 2, "total_tokens": 6}',
        b"[4, 2, 6]",
        b'"lots"',
    ],
)
def test_a_pd_usage_that_is_not_counts_becomes_the_routers_own(config, char_renderer, pd_usage):
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    tr = StreamTranslator(context(config, **asked), char_renderer(), PD)
    tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105], "finish_reason": "stop"}]))
    frame = tr.translate(b'{"request_id": "rid", "choices": [], "usage": ' + pd_usage + b"}")
    assert strict_json(frame)["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert tr.malformed == 1 and tr.closing_usage() is None


def test_a_valid_pd_usage_is_relayed_as_its_three_counts(config, char_renderer):
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    tr = StreamTranslator(context(config, **asked), char_renderer(), PD)
    tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105], "finish_reason": "stop"}]))
    pd_usage = b'{"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "details": {"x": NaN}}'
    frame = tr.translate(b'{"request_id": "rid", "choices": [], "usage": ' + pd_usage + b"}")
    assert strict_json(frame)["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert tr.malformed == 0


@pytest.mark.parametrize("bad", [-1, 2**40])
def test_token_ids_outside_the_vocabulary_are_the_pds_invalid_answer(config, char_renderer, bad):
    """They were a plain 502 never charged to the PD, so it was never ejected."""
    result = GenerateResponse.model_validate({"request_id": "rid", "choices": [{"token_ids": [72, bad]}]})
    with pytest.raises(UpstreamError) as err:
        completion(context(config), result, char_renderer(), PD)
    tr = StreamTranslator(context(config, stream=True), char_renderer(), PD)
    with pytest.raises(UpstreamError) as stream_err:
        tr.translate(payload(choices=[{"index": 0, "token_ids": [bad]}]))
    for e in (err.value, stream_err.value):
        assert e.status == 502 and e.failure is Failure.error and e.retry_other and e.engine_id == PD.id
        assert "outside the model's vocabulary" in e.message
        assert e.for_client().message == "the engine sent an invalid answer"


def test_logprobs_get_vllms_floor_and_defaults():
    """max(logprob, -9999.0) as vLLM's answers have it (a raw logit above 0 stays: vLLM's
    --logprobs-mode raw_logits); a missing field takes ChatCompletionLogProb's default; fields
    beyond vLLM's are dropped; `content: null` stays."""
    raw = {
        "content": [
            {"token": "token_id:1", "logprob": -12345.6, "extra": float("nan")},
            {"token": "token_id:2", "logprob": 3.5, "bytes": [97], "top_logprobs": [{"token": "token_id:2"}]},
        ],
        "other": 1,
    }
    assert client_logprobs(raw, PD) == {
        "content": [
            {"token": "token_id:1", "logprob": -9999.0, "bytes": None, "top_logprobs": []},
            {
                "token": "token_id:2",
                "logprob": 3.5,
                "bytes": [97],
                "top_logprobs": [{"token": "token_id:2", "logprob": -9999.0, "bytes": None}],
            },
        ]
    }
    assert client_logprobs({"content": None}, PD) == {"content": None}
    assert client_logprobs(None, PD) is None
