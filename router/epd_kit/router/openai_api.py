"""The OpenAI chat-completions surface: request validation, SamplingParams builtins
(contract §1.2 step 4) and the response / chunk bodies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from epd_kit.router.errors import RouterError, bad_request

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


class ChatCompletionRequest(BaseModel):
    """What we accept. Unknown OpenAI fields are tolerated (ignored), like vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_generation_prompt: bool = True
    extra_args: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("at most 16 stop sequences")
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
        return sp


def parse_request(data: Any) -> ChatCompletionRequest:
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    if "messages" not in data:
        raise bad_request("'messages' is required", param="messages")
    if not isinstance(data["messages"], list) or not data["messages"]:
        raise bad_request("'messages' must be a non-empty list", param="messages")
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
