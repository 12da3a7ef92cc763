"""Request validation and SamplingParams builtins (docs/contract.md §1.2 step 4)."""

import pytest

from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request

MSG = [{"role": "user", "content": "hi"}]


def test_defaults_are_omitted():
    req = parse_request({"messages": MSG})
    assert req.sampling_params() == {"output_kind": 2}
    assert parse_request({"messages": MSG, "stream": True}).sampling_params() == {"output_kind": 1}


def test_non_defaults_are_sent():
    req = parse_request(
        {
            "messages": MSG,
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "n": 2,
            "stop": "END",
            "seed": 3,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "logprobs": True,
            "top_logprobs": 2,
            "skip_special_tokens": False,
            "extra_args": {"k": 1},
            "top_k": -1,
        }
    )
    assert req.sampling_params() == {
        "max_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "n": 2,
        "stop": ["END"],
        "seed": 3,
        "ignore_eos": True,
        "stop_token_ids": [7],
        "logprobs": 2,
        "skip_special_tokens": False,
        "extra_args": {"k": 1},
        "output_kind": 2,
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


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("best_of", 3),
        ("echo", True),
        ("use_beam_search", True),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("guided_json", {"type": "object"}),
        ("reasoning_effort", "high"),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(field, value):
    with pytest.raises(RouterError) as info:
        parse_request({"messages": MSG, field: value})
    assert info.value.status == 400 and info.value.param == field
    assert f"'{field}' is not supported" in info.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", []),
        ("tool_choice", "none"),
        ("best_of", 1),
        ("echo", False),
        ("user", "u-1"),
        ("parallel_tool_calls", False),
        ("metadata", {"k": "v"}),
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(field, value):
    assert parse_request({"messages": MSG, field: value}).sampling_params() == {"output_kind": 2}


def test_structured_outputs_reach_the_pd_as_vllm_sends_them():
    """vLLM's chat server maps response_format into SamplingParams.structured_outputs; its
    generate endpoint takes that field (and logit_bias) as is."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert parse_request({"messages": MSG, "response_format": as_schema}).sampling_params()["structured_outputs"] == {
        "json": schema
    }
    assert parse_request({"messages": MSG, "response_format": {"type": "json_object"}}).sampling_params()[
        "structured_outputs"
    ] == {"json_object": True}
    as_text = parse_request({"messages": MSG, "response_format": {"type": "text"}})
    assert "structured_outputs" not in as_text.sampling_params()
    vllm_style = {"choice": ["yes", "no"], "disable_any_whitespace": True}
    assert (
        parse_request({"messages": MSG, "structured_outputs": vllm_style}).sampling_params()["structured_outputs"]
        == vllm_style
    )
    assert parse_request({"messages": MSG, "logit_bias": {"50256": -100}}).sampling_params()["logit_bias"] == {
        "50256": -100
    }


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "not both"),
        ({"logit_bias": {"the": 1}}, "keys are token ids"),
        ({"logit_bias": {"1": 101}}, "outside [-100, 100]"),
        ({"model": "m" * 2000}, "model"),
    ],
)
def test_bad_structured_output_requests_are_400(extra, needle):
    with pytest.raises(RouterError) as info:
        parse_request({"messages": MSG, **extra})
    assert info.value.status == 400 and needle in info.value.message


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"top_k": 10**30}, "top_k"),
        ({"stop_token_ids": [10**30]}, "stop_token_ids.0"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 10**30}, "min_tokens"),
        ({"logit_bias": {"9" * 30: 1}}, "logit_bias"),
    ],
)
def test_integer_fields_are_bounded_with_a_400_naming_the_field(extra, field):
    """top_k 10^30 and stop_token_ids [10^30] reached the PD."""
    with pytest.raises(RouterError) as info:
        parse_request({"messages": [{"role": "user", "content": "hi"}], **extra})
    assert info.value.status == 400 and info.value.param == field


def test_min_tokens_above_max_tokens_is_a_400():
    with pytest.raises(RouterError) as info:
        parse_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 5})
    assert info.value.status == 400 and "min_tokens (5) must not exceed max_tokens (4)" in info.value.message
    assert parse_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "min_tokens": 5})
