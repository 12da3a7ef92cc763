"""router/context_window.py: vLLM's chat-route refusals of a request the context cannot hold,
their order and messages (the compat tier compares them with vLLM's own answers:
tests/compat/test_front_refusals.py)."""

from __future__ import annotations

import pytest

from epd_kit.router import context_window
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from epd_kit.router_yaml import FRONT_CHECKS_024 as F24
from epd_kit.router_yaml import FRONT_CHECKS_032 as F32
from epd_kit.router_yaml import parse_config


def request(**fields):
    return parse_request({"messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(call, *args) -> RouterError:
    with pytest.raises(RouterError) as err:
        call(*args)
    assert err.value.status == 400 and err.value.type == "BadRequestError"
    return err.value


def test_output_tokens_above_the_context():
    err = refusal(context_window.check_output, request(max_tokens=100000), 8192, F24)
    assert err.param == "max_tokens"
    assert err.message == (
        "max_tokens=100000 cannot be greater than max_model_len=max_total_tokens=8192. "
        "Please request fewer output tokens. (parameter=max_tokens, value=100000)"
    )
    # max_completion_tokens counts when given, as vLLM's build_tok_params says
    err = refusal(context_window.check_output, request(max_tokens=4, max_completion_tokens=9000), 8192, F24)
    assert err.param == "max_completion_tokens" and err.message.startswith("max_completion_tokens=9000 ")
    context_window.check_output(request(max_tokens=8192), 8192, F24)  # the whole context: the prompt check's
    context_window.check_output(request(max_tokens=100000), None, F24)  # no context known: the PD's limits


def test_prompt_and_output_above_the_context_report_where_vllm_tokenizer_stops():
    err = refusal(context_window.check_prompt, request(max_tokens=8190), 20, 8192, F24)
    assert err.param == "input_tokens"
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, you requested 8190 output tokens "
        "and your prompt contains at least 3 input tokens, for a total of at least 8193 tokens. Please "
        "reduce the length of the input prompt or the number of requested output tokens. "
        "(parameter=input_tokens, value=3)"
    )
    # no max_tokens: the prompt alone against the context
    err = refusal(context_window.check_prompt, request(), 9000, 8192, F24)
    assert "requested 0 output tokens and your prompt contains at least 8193 input tokens" in err.message
    context_window.check_prompt(request(max_tokens=8172), 20, 8192, F24)  # exactly the context: served


def test_the_template_text_is_checked_first_by_its_characters():
    err = refusal(context_window.check_prompt, request(max_tokens=8190), 20, 8192, F24, 71, 16)
    assert err.param == "input_text"
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, you requested 8190 output tokens "
        "and your prompt contains 71 characters (more than 32 characters, which is the upper bound for 2 "
        "input tokens). Please reduce the length of the input prompt or the number of requested output "
        "tokens. (parameter=input_text, value=71)"
    )
    # within the characters' bound: the tokens decide
    err = refusal(context_window.check_prompt, request(max_tokens=8190), 20, 8192, F24, 30, 16)
    assert err.param == "input_tokens"


def test_a_032_front_names_the_context_max_model_len():
    """vLLM 0.32.0's chat route: build_tok_params sets max_total_tokens_param="max_model_len"."""
    err = refusal(context_window.check_output, request(max_tokens=100000), 8192, F32)
    assert err.message == (
        "max_tokens=100000 cannot be greater than max_model_len=8192. "
        "Please request fewer output tokens. (parameter=max_tokens, value=100000)"
    )


def test_a_032_front_checks_the_prompt_alone():
    """vLLM 0.32.0 renderers/params.py: max_input_tokens is the context, so a prompt plus
    max_tokens over it is served (clamped) and a prompt alone over it has its own message."""
    context_window.check_prompt(request(max_tokens=8190), 20, 8192, F32)  # served: 0.24 refused it
    context_window.check_prompt(request(max_tokens=8192), 8192, 8192, F32)  # the prompt the whole context
    err = refusal(context_window.check_prompt, request(max_tokens=5), 9000, 8192, F32)
    assert err.param == "input_tokens"
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least "
        "8193 input tokens, which exceeds this limit even without any output tokens. Please reduce the "
        "length of the input prompt. (parameter=input_tokens, value=8193)"
    )
    err = refusal(context_window.check_prompt, request(), 20, 8192, F32, 131089, 16)
    assert err.param == "input_text"
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, your prompt contains 131089 "
        "characters (more than 131072 characters, which is the upper bound for 8192 input tokens). "
        "Please reduce the length of the input prompt. (parameter=input_text, value=131089)"
    )


def test_a_router_yaml_without_the_key_keeps_the_024_checks(config):
    assert parse_config(config()).front_checks == F24
    assert parse_config(config(front_checks="vllm-0.32")).front_checks == F32
    with pytest.raises(ValueError, match="front_checks"):
        parse_config(config(front_checks="0.32"))
