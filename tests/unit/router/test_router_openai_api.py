"""Request validation and SamplingParams builtins (contract §1.2 step 4)."""

import pytest

from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request

MSG = [{"role": "user", "content": "hi"}]


def test_defaults_are_omitted():
    req = parse_request({"messages": MSG})
    assert req.sampling_params() == {"output_kind": 2}
    assert parse_request({"messages": MSG, "stream": True}).sampling_params() == {"output_kind": 1}


def test_non_defaults_are_sent():
    req = parse_request({
        "messages": MSG, "max_tokens": 5, "max_completion_tokens": 9, "temperature": 0,
        "top_p": 0.5, "n": 2, "stop": "END", "seed": 3, "ignore_eos": True,
        "stop_token_ids": [7], "logprobs": True, "top_logprobs": 2, "skip_special_tokens": False,
        "extra_args": {"k": 1}, "top_k": -1,
    })
    assert req.sampling_params() == {
        "max_tokens": 9, "temperature": 0, "top_p": 0.5, "n": 2, "stop": ["END"], "seed": 3,
        "ignore_eos": True, "stop_token_ids": [7], "logprobs": 2, "skip_special_tokens": False,
        "extra_args": {"k": 1}, "output_kind": 2,
    }


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([], "must be a JSON object"),
        ({}, "'messages' is required"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": MSG, "stream_options": {"include_usage": True}}, "only allowed when stream"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "n": 0}, "n:"),
    ],
)
def test_bad_requests_are_400_with_a_message(body, needle):
    with pytest.raises(RouterError) as info:
        parse_request(body)
    assert info.value.status == 400
    assert needle in info.value.message


def test_include_usage_only_when_asked():
    assert not parse_request({"messages": MSG, "stream": True}).include_usage
    assert parse_request({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}).include_usage
