"""PD answers -> OpenAI bodies: the completion body and the stream's chunk frames; token ids
outside the vocabulary are the PD's invalid answer, and a PD's usage reaches the client only
as non-negative integers that add up."""

from __future__ import annotations

import json

import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.errors import Failure, UpstreamError
from epd_kit.router.openai_api import parse_request
from epd_kit.router.pools import Engine
from epd_kit.router.translate import LogprobTokens, StreamTranslator, client_logprobs, completion
from epd_kit.router_yaml import parse_config
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


def test_logprobs_get_vllms_floor_and_defaults(char_renderer):
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
    assert client_logprobs(raw, PD, LogprobTokens(char_renderer()), 1) == {
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
    assert client_logprobs({"content": None}, PD, LogprobTokens(char_renderer()), 1) == {"content": None}
    assert client_logprobs(None, PD, LogprobTokens(char_renderer()), 1) is None


# vLLM 0.32.0's generate answer, written by its own code (the 0.32 env:
# ServingTokens._create_tokens_logprobs with num_output_top_logprobs=0, as the router asks for
# `logprobs: true` without top_logprobs, then GenerateTokensChoice(...).model_dump_json()):
# token ids, a rank, and max(0, 1) = 1 candidate per position.
CHOICE_032 = (
    '{"index":0,"finish_reason":"stop","stop_reason":null,"token_ids":[72,105],"routed_experts":null,'
    '"sampling_mask":null,"weight_versions":null,"logprobs":{"content":[{"token_id":72,"logprob":-0.25,'
    '"rank":1,"top_logprobs":[{"token_id":72,"logprob":-0.25,"rank":1}]},{"token_id":105,"logprob":-0.5,'
    '"rank":2,"top_logprobs":[{"token_id":105,"logprob":-0.5,"rank":2}]}]}}'
)
# the same with num_output_top_logprobs=2 (`top_logprobs: 2`)
CHOICE_032_TOP2 = (
    '{"index":0,"finish_reason":"stop","stop_reason":null,"token_ids":[72,105],"routed_experts":null,'
    '"sampling_mask":null,"weight_versions":null,"logprobs":{"content":[{"token_id":72,"logprob":-0.25,'
    '"rank":1,"top_logprobs":[{"token_id":72,"logprob":-0.25,"rank":1},{"token_id":105,"logprob":-1.5,'
    '"rank":2}]},{"token_id":105,"logprob":-0.5,"rank":2,"top_logprobs":[{"token_id":105,"logprob":-0.5,'
    '"rank":2},{"token_id":72,"logprob":-0.1,"rank":1}]}]}}'
)


def test_a_032_answer_s_token_id_logprobs_become_vllms_chat_logprobs(config, char_renderer):
    """0.32's ids are decoded as vLLM's chat route does (decode([id]), its UTF-8 bytes), the
    rank dropped, and as many candidates kept as the client asked (the chat route's rule):
    none for `logprobs: true`, two for `top_logprobs: 2`. Through both paths."""
    plain = {"logprobs": True}
    result = GenerateResponse.model_validate({"request_id": "rid", "choices": [json.loads(CHOICE_032)]})
    body = completion(context(config, **plain), result, char_renderer(), PD)
    assert body["choices"][0]["message"]["content"] == "Hi"
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": []},
            {"token": "i", "logprob": -0.5, "bytes": [105], "top_logprobs": []},
        ]
    }
    tr = StreamTranslator(context(config, stream=True, logprobs=True, top_logprobs=2), char_renderer(), PD)
    chunk = frame_doc(tr.translate(payload(choices=[json.loads(CHOICE_032_TOP2)])))
    (choice,) = chunk["choices"]
    assert choice["delta"] == {"role": "assistant", "content": "Hi"}
    assert choice["logprobs"]["content"][1] == {
        "token": "i",
        "logprob": -0.5,
        "bytes": [105],
        "top_logprobs": [
            {"token": "i", "logprob": -0.5, "bytes": [105]},
            {"token": "H", "logprob": -0.1, "bytes": [72]},
        ],
    }


def test_a_token_id_s_bytes_are_its_utf8_and_a_bad_id_is_the_pds_invalid_answer(char_renderer):
    """A token beyond ASCII: its bytes are its UTF-8 (vLLM: `token.encode("utf-8",
    errors="replace")`); an id outside the vocabulary, or no integer, is the PD's invalid
    answer (a 502 charged to it)."""
    raw = {"content": [{"token_id": 0xE9, "logprob": -1.0, "top_logprobs": []}]}
    assert client_logprobs(raw, PD, LogprobTokens(char_renderer()), None)["content"][0]["bytes"] == list(
        "\u00e9".encode()
    )
    for bad in (-1, "7", None):
        with pytest.raises(UpstreamError) as err:
            client_logprobs({"content": [{"token_id": bad, "logprob": -1.0}]}, PD, LogprobTokens(char_renderer()), None)
        assert err.value.status == 502 and err.value.engine_id == PD.id and "logprobs" in err.value.message


class ByteRenderer:
    """Token id N < 256 is the byte N, decoded as a byte-fallback vocabulary decodes: an open
    UTF-8 sequence is U+FFFD."""

    def detokenize(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_token_inside_a_utf8_sequence_is_decoded_as_vllms_logprobs_processor_does():
    """vllm 0.32.0 v1/engine/logprobs.py `_correct_decoded_token`: "" while the sequence is
    open, the whole character on the token that completes it (the preceding sampled ids as
    context, kept across a stream's chunks), a candidate at that position the same way."""
    e_acute = list("\u00e9".encode())  # [0xC3, 0xA9]
    tokens = LogprobTokens(ByteRenderer())
    first = {"content": [{"token_id": ord("a"), "logprob": -0.1}, {"token_id": e_acute[0], "logprob": -0.2}]}
    second = {
        "content": [
            {
                "token_id": e_acute[1],
                "logprob": -0.3,
                "top_logprobs": [{"token_id": e_acute[1], "logprob": -0.3}, {"token_id": 0xA8, "logprob": -2.0}],
            }
        ]
    }
    one = client_logprobs(first, PD, tokens, 2)["content"]
    two = client_logprobs(second, PD, tokens, 2)["content"]
    assert [(p["token"], p["bytes"]) for p in one] == [("a", [97]), ("", [])]
    assert (two[0]["token"], two[0]["bytes"]) == ("\u00e9", e_acute)
    assert [c["token"] for c in two[0]["top_logprobs"]] == ["\u00e9", "\u00e8"]
    # no context that completes it: "" (vLLM's last resort)
    alone = client_logprobs({"content": [{"token_id": 0xA9, "logprob": -1.0}]}, PD, LogprobTokens(ByteRenderer()), 0)
    assert alone["content"][0]["token"] == ""
