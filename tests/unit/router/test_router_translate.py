"""PD answers -> OpenAI bodies: the completion body and the stream's chunk frames."""

from __future__ import annotations

import json

from epd_kit.router.config import parse_config
from epd_kit.router.context import RequestContext
from epd_kit.router.openai_api import parse_request
from epd_kit.router.translate import StreamTranslator, completion
from epd_kit.wire import GenerateResponse


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
    body = completion(ctx, result, char_renderer())
    assert body["id"] == "chatcmpl-rid" and body["object"] == "chat.completion" and body["model"] == "/m"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop", "token_ids": [72, 105]}
    ]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_stream_chunks_without_usage(config, char_renderer):
    tr = StreamTranslator(context(config, stream=True), char_renderer())
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
    tr = StreamTranslator(context(config, **asked), char_renderer())
    chunk = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105]}])))
    assert chunk["usage"] is None  # present on every chunk, null but on the usage chunk
    pd_usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    usage = frame_doc(tr.translate(payload(usage=pd_usage)))
    assert usage["choices"] == [] and usage["usage"] == pd_usage
    assert tr.closing_usage() is None  # already sent

    tr = StreamTranslator(context(config, **asked), char_renderer())
    tr.translate(payload(choices=[{"index": 0, "token_ids": [72, 105, 33]}]))
    ours = frame_doc(tr.closing_usage())
    assert ours["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_stream_choices_are_detokenized_apart(config, char_renderer):
    tr = StreamTranslator(context(config, stream=True, n=2), char_renderer())
    doc = frame_doc(tr.translate(payload(choices=[{"index": 0, "token_ids": [65]}, {"index": 1, "token_ids": [66]}])))
    assert [c["delta"] for c in doc["choices"]] == [
        {"role": "assistant", "content": "A"},
        {"role": "assistant", "content": "B"},
    ]
    doc = frame_doc(tr.translate(payload(choices=[{"index": 1, "token_ids": [67]}])))
    assert doc["choices"] == [{"index": 1, "delta": {"content": "C"}, "finish_reason": None}]
    assert tr.completion_tokens == 3


def test_pd_error_frames_are_reported_not_relayed_and_junk_is_counted(config, char_renderer):
    """Issue 33: a PD error frame was relayed verbatim (an engine address among its fields);
    the relay now writes the router's own frame from `engine_error`."""
    tr = StreamTranslator(context(config, stream=True), char_renderer())
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
