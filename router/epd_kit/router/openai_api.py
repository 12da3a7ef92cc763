"""The OpenAI chat-completions surface: request validation, SamplingParams builtins
(docs/contract.md §1.2 step 4) and the response / chunk bodies.

Structured outputs reach the PD the way vLLM's own chat server sends them: `response_format`
(`json_object`, `json_schema`) or vLLM's `structured_outputs` become
`sampling_params.structured_outputs`, and `logit_bias` goes as is (vLLM's generate endpoint
takes a full SamplingParams). Fields the kit cannot honour (tools, beam search, echo, custom
templates, ...) answer 400 naming the field: ignoring them would silently answer a different
question. Other unknown fields are tolerated, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from epd_kit.router.errors import RouterError, bad_request

# Integer fields are bounded to what a 32-bit signed integer holds (token ids, counts): the
# engine's sampling state keeps them in fixed-width tensors, and no real value comes near.
# vLLM itself refuses top_k above the vocabulary and min_tokens above max_tokens; the router
# checks what it can without the vocabulary (the engine still checks the rest).
INT32_MAX = 2**31 - 1

# vLLM RequestOutputKind: the chat server asks DELTA when streaming, FINAL_ONLY otherwise
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `StructuredOutputsParams`: exactly one constraint, plus options."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [self.json_, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag]
        if sum(v is not None for v in given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object, structural_tag")
        return self

    def builtins(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


# OpenAI (and vLLM) request fields the kit does not implement: each answers 400 naming it,
# unless its value asks for nothing (e.g. `tools: []`). name -> (neutral values, why).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "tool calling is not supported by this router"),
    "tool_choice": ((None, "none"), "tool calling is not supported by this router"),
    "functions": ((None, []), "function calling is not supported by this router"),
    "function_call": ((None, "none"), "function calling is not supported by this router"),
    "best_of": ((None, 1), "best_of is not supported (vLLM V1 has none); use n"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "echo": ((None, False), "echo is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
    "prompt_logprobs": ((None,), "prompt_logprobs are not supported"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "documents": ((None, []), "documents are not supported"),
    "chat_template": ((None,), "the checkpoint's own chat template is always used"),
    "chat_template_kwargs": ((None, {}), "only add_generation_prompt reaches the chat template"),
    "mm_processor_kwargs": ((None, {}), "images are processed under the router's limits only"),
    **dict.fromkeys(
        (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
        ),
        ((None,), "guided_* fields are gone from vLLM: use response_format or structured_outputs"),
    ),
}


class ChatCompletionRequest(BaseModel):
    """What we accept. Unknown fields are tolerated (ignored), like vLLM does, except the
    `UNSUPPORTED` ones."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=1024)
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(default=None, max_length=1024)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_generation_prompt: bool = True
    extra_args: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit() or len(token) > 10 or int(token) > INT32_MAX:
                raise ValueError(f"keys are token ids, got {token[:20]!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"bias {value} for token {token} is outside [-100, 100]")
        return bias

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        constrained_format = self.response_format is not None and self.response_format.type != "text"
        if self.structured_outputs is not None and constrained_format:
            raise ValueError("give either response_format or structured_outputs, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("at most 16 stop sequences")
        max_tokens = self.resolved_max_tokens
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})")
        return self

    @property
    def include_usage(self) -> bool:
        """OpenAI semantics: a usage chunk only when the client asked for one."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self) -> dict[str, Any]:
        """vLLM SamplingParams as builtins, non-default fields only (msgspec omit_defaults)."""
        sp: dict[str, Any] = {}
        if self.resolved_max_tokens is not None:
            sp["max_tokens"] = self.resolved_max_tokens
        defaults: dict[str, Any] = {
            "n": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_tokens": 0,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False,
        }
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is not None and value != default and not (name == "top_k" and value == -1):
                sp[name] = value
        if self.seed is not None:
            sp["seed"] = self.seed
        if self.stop:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            sp["stop_token_ids"] = list(self.stop_token_ids)
        if self.logprobs:
            sp["logprobs"] = self.top_logprobs or 0
        sp["output_kind"] = OUTPUT_KIND_DELTA if self.stream else OUTPUT_KIND_FINAL_ONLY
        if self.extra_args:
            sp["extra_args"] = dict(self.extra_args)
        if (structured := self._structured_outputs()) is not None:
            sp["structured_outputs"] = structured
        if self.logit_bias:
            sp["logit_bias"] = dict(self.logit_bias)
        return sp

    def _structured_outputs(self) -> dict[str, Any] | None:
        """vLLM's mapping (ChatCompletionRequest.to_sampling_params): json_object -> json_object,
        json_schema -> json = the schema."""
        if self.structured_outputs is not None:
            return self.structured_outputs.builtins()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"json_object": True}
        assert fmt.json_schema is not None
        return {"json": fmt.json_schema.json_schema}


def parse_request(data: Any) -> ChatCompletionRequest:
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    if "messages" not in data:
        raise bad_request("'messages' is required", param="messages")
    if not isinstance(data["messages"], list) or not data["messages"]:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    for name, (neutral, why) in UNSUPPORTED.items():
        if name in data and data[name] not in neutral:
            raise bad_request(f"'{name}' is not supported: {why}; remove it from the request", param=name)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
        where = f"{loc}: " if loc else ""
        raise RouterError(400, f"invalid request: {where}{msg}{more}", param=loc) from None


def completion_body(
    *,
    completion_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
) -> dict[str, Any]:
    completion_tokens = sum(len(c.get("token_ids") or []) for c in choices)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chunk_body(
    *,
    completion_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    include_usage: bool,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:  # OpenAI: every chunk carries `usage`, null except the last one
        body["usage"] = usage
    return body
