"""The OpenAI front's context-length checks: what vLLM's own chat route refuses before its
engine, and its generate route (the one the router calls) does not.

vLLM's chat route builds `TokenizeParams(max_total_tokens=max_model_len,
max_output_tokens=max_completion_tokens or max_tokens or 0)` for every request
(vllm/entrypoints/openai/chat_completion/protocol.py `build_tok_params`) and refuses, with a
400 `BadRequestError` (vllm/renderers/params.py, v0.24.0 and v0.29.0 alike):

- in `TokenizeParams.__post_init__`, before rendering: output tokens above the context;
- in `_text_len_check`, before tokenizing: the chat template's text longer than the context
  less the output tokens, times the longest token's characters of the vocabulary (parameter
  `input_text`);
- in `_token_len_check`, after tokenizing: prompt tokens above the context less the output
  tokens. vLLM's tokenizer stops at `max_input_tokens + 1` tokens (`get_encode_kwargs`), so the
  count it reports is that, "at least"; the router reports the same.

The message is `str(VLLMValidationError)`: the text, then `(parameter=..., value=...)`
(vllm/exceptions.py), with `param` the parameter (vllm/entrypoints/serve/utils/error_response.py
`create_error_response`, 0.24.0; 0.29.0 the same). The generate route takes `max_tokens` as it
is and stops the request at the context (vllm/entrypoints/serve/disagg/serving.py): a client
of the kit would get a 200 cut short where vLLM's front says 400.

`max_model_len` is the PDs' own (engine_client.py reads each PD's `/v1/models`); unknown (no
PD has answered yet), the checks are skipped and the PD's own limits hold. An image prompt is
checked on its template text (one placeholder an image) and then on its tokens with each image's
placeholders expanded, what the PD takes; whether vLLM's chat route counts them expanded no test
here compares (the compat tier's bodies that reach the prompt checks are text).

vLLM 0.32 checks differently (vllm/renderers/params.py at 0.32.0), router.yaml `front_checks:
vllm-0.32`: `max_input_tokens` is the context itself, no longer less the output tokens, so a
prompt plus `max_tokens` over the context is served (the chat route clamps `max_tokens` with
`get_max_tokens`; the generate route the router calls stops the request at the context: the
same tokens); `_text_len_check` and `_token_len_check` refuse a prompt alone over the context,
with messages that name no output tokens ("... exceeds this limit even without any output
tokens"); the output check's message reads `max_model_len=N` (chat_completion/protocol.py
`build_tok_params` sets `max_total_tokens_param="max_model_len"`). Between 0.29.0 and 0.32.0
no release was read; the plan only runs those (plan/neuron_releases.py front_checks_of).
"""

from __future__ import annotations

from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import ChatCompletionRequest
from epd_kit.router_yaml import FRONT_CHECKS_032, FrontChecks

ERROR_TYPE = "BadRequestError"  # vLLM's type for a VLLMValidationError


def _refusal(message: str, parameter: str, value: int) -> RouterError:
    return RouterError(400, f"{message} (parameter={parameter}, value={value})", param=parameter, type_=ERROR_TYPE)


def _output(request: ChatCompletionRequest) -> tuple[int, str]:
    """The output tokens asked for (0 for none) and the field that asked, as vLLM names it."""
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens or 0, "max_tokens"


def check_output(request: ChatCompletionRequest, max_model_len: int | None, front: FrontChecks) -> None:
    """Before rendering: the output tokens asked for fit the context."""
    output, parameter = _output(request)
    # 0.24/0.29 name the context max_total_tokens too (the param's default name in params.py)
    context_name = "max_model_len" if front == FRONT_CHECKS_032 else "max_model_len=max_total_tokens"
    if max_model_len is not None and output > max_model_len:
        raise _refusal(
            f"{parameter}={output} cannot be greater than {context_name}={max_model_len}. "
            "Please request fewer output tokens.",
            parameter,
            output,
        )


def check_prompt(
    request: ChatCompletionRequest,
    prompt_tokens: int,
    max_model_len: int | None,
    front: FrontChecks,
    prompt_chars: int | None = None,
    max_chars_per_token: int | None = None,
) -> None:
    """After rendering: the prompt (0.24/0.29: and the output tokens asked for) fit the
    context; first by the template text's characters when the renderer tells them, as vLLM
    does."""
    if max_model_len is None:
        return
    if front == FRONT_CHECKS_032:
        _check_prompt_032(prompt_tokens, max_model_len, prompt_chars, max_chars_per_token)
        return
    output, _ = _output(request)
    max_input = max_model_len - output
    if prompt_chars is not None and max_chars_per_token is not None and prompt_chars > max_input * max_chars_per_token:
        raise _refusal(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{output} output tokens and your prompt contains {prompt_chars} characters (more than "
            f"{max_input * max_chars_per_token} characters, which is the upper bound for {max_input} "
            "input tokens). Please reduce the length of the input prompt or the number of requested "
            "output tokens.",
            "input_text",
            prompt_chars,
        )
    if prompt_tokens > max_input:
        counted = min(prompt_tokens, max_input + 1)  # where vLLM's tokenizer stops
        qualifier = "at least " if counted == max_input + 1 else ""
        raise _refusal(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{output} output tokens and your prompt contains {qualifier}{counted} input tokens, "
            f"for a total of {qualifier}{counted + output} tokens. Please reduce the length of the "
            "input prompt or the number of requested output tokens.",
            "input_tokens",
            counted,
        )


def _check_prompt_032(
    prompt_tokens: int, max_model_len: int, prompt_chars: int | None, max_chars_per_token: int | None
) -> None:
    """vLLM 0.32.0's `_text_len_check` and `_token_len_check` (renderers/params.py): the
    prompt alone against the context."""
    if (
        prompt_chars is not None
        and max_chars_per_token is not None
        and prompt_chars > max_model_len * max_chars_per_token
    ):
        raise _refusal(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {prompt_chars} characters (more than {max_model_len * max_chars_per_token} "
            f"characters, which is the upper bound for {max_model_len} input tokens). Please reduce "
            "the length of the input prompt.",
            "input_text",
            prompt_chars,
        )
    if prompt_tokens > max_model_len:
        counted = min(prompt_tokens, max_model_len + 1)  # where vLLM's tokenizer stops
        qualifier = "at least " if counted == max_model_len + 1 else ""
        raise _refusal(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {qualifier}{counted} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            counted,
        )
