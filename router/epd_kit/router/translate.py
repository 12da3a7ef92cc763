"""PD answers -> OpenAI bodies: the `chat.completion` of a non-streaming request, and the
`chat.completion.chunk` SSE frames of a stream (no I/O: the generation module feeds it).

Tokens become text on the router as vLLM's detokenizer makes it, one step per token, for a
completion and per choice for a stream (a multi-byte character is never split across chunks,
a tail that never completes is left out: preprocess/text.py IncrementalDetokenizer). A token id outside the
model's vocabulary is the PD's invalid answer (`upstream.bad_body`): charged to it, and a
non-streaming request moves to another PD (the completion is built inside the PD call,
engine_client.generate's `accept`). Usage follows OpenAI: a stream carries it only when the
client asked (`stream_options.include_usage`); the PD's usage is relayed only when its counts
are non-negative integers that add up, else the router's own count is sent. A PD's logprobs
(`client_logprobs`) are relayed in both paths when present, clamped and checked as vLLM's own
OpenAI server would have them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from epd_kit.preprocess.text import TokenIdOutOfRange
from epd_kit.router import upstream
from epd_kit.router.context import RequestContext
from epd_kit.router.openai_api import chunk_body, completion_body
from epd_kit.router.pools import Engine
from epd_kit.router.rendering import DetokenizerLike, Renderer
from epd_kit.wire import GenerateResponse

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")

DONE_FRAME = b"data: [DONE]\n\n"

# The floor vLLM puts under a logprob in its OpenAI answers, `max(logprob, -9999.0)`, which
# makes -inf (a token of probability 0) a number JSON can carry: vllm 0.24.0
# entrypoints/serve/disagg/serving.py `_create_tokens_logprobs` (the PD's own generate
# answer), entrypoints/openai/chat_completion/serving.py `_create_chat_logprobs` and
# `_get_top_logprobs`; chat_completion/protocol.py `ChatCompletionLogProb.logprob` defaults to
# it. `max` lets NaN through (and +inf), and pydantic writes them as null: those stay the PD's
# invalid answer here.
LOGPROB_FLOOR = -9999.0


# json.dumps(doc, separators=(",", ":"), ensure_ascii=False), without an encoder built per
# frame (one per token of a stream)
_frame_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse_frame(doc: dict[str, Any]) -> bytes:
    return b"data: " + _frame_json(doc).encode() + b"\n\n"


class engine_tokens:
    """Around detokenizing `engine`'s answer: token ids that are not the model's (-1, 2**40, a
    string) are its invalid answer, an `UpstreamError` charged to it (a 502, an error frame
    in a stream), never a 500. A class rather than a generator context manager: it wraps
    every frame of a stream."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None and issubclass(exc_type, TokenIdOutOfRange):
            raise upstream.bad_body(self._engine, str(exc)) from None


def client_logprobs(
    raw: object, engine: Engine, tokens: LogprobTokens, top_logprobs: int | None
) -> dict[str, Any] | None:
    """A PD choice's `logprobs` as the client gets them, or None: vLLM's
    `ChatCompletionLogProbs`, `content` a list (or null) of {token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}, with vLLM's defaults for a missing logprob
    (LOGPROB_FLOOR), bytes (null) and top_logprobs ([]); other fields are dropped. A logprob
    below LOGPROB_FLOOR (-inf) becomes the floor, as in vLLM's answers; NaN, +inf or a field
    of the wrong type is `engine`'s invalid answer (`upstream.bad_body`, charged to it): it is
    no JSON number (the encoder refused it: a 500) or no answer vLLM gives.

    An entry is either shape of wire.GenerateChoice.logprobs: a token string (vLLM 0.24/0.29)
    or a token id (0.32), which `tokens` (the choice's, across its stream chunks) decodes as
    vLLM's chat route does. `top_logprobs`
    (the client's, None when it asked for none) keeps as many candidates as that route would:
    0.32's generate route sends max(n, 1) of them."""
    if raw is None:
        return None
    # vLLM's chat route keeps the first `top_logprobs` (None: none): vllm 0.32.0
    # entrypoints/openai/chat_completion/serving.py `_get_top_logprobs`
    keep = top_logprobs or 0
    try:
        if not isinstance(raw, dict):
            raise ValueError("are not an object")
        content = raw.get("content")
        if content is None:
            return {"content": None}
        return {"content": [_logprob_position(p, tokens, keep) for p in _logprob_list(content)]}
    except (ValueError, TokenIdOutOfRange) as exc:
        raise upstream.bad_body(engine, f"logprobs {exc}") from None


def _logprob_list(value: object) -> list:
    if not isinstance(value, list):
        raise ValueError(f"have {type(value).__name__} where a list belongs")
    return value


def _logprob_position(entry: object, tokens: LogprobTokens, keep: int) -> dict[str, Any]:
    position = _logprob_candidate(entry, tokens)
    top = _logprob_list(_logprob_object(entry).get("top_logprobs", []))
    position["top_logprobs"] = [_logprob_candidate(c, tokens) for c in top[:keep]]
    tokens.sampled(_logprob_object(entry).get("token_id"))
    return position


def _logprob_object(entry: object) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ValueError("have an entry that is not an object")
    return entry


def _logprob_candidate(raw: object, tokens: LogprobTokens) -> dict[str, Any]:
    entry = _logprob_object(raw)
    logprob = entry.get("logprob", LOGPROB_FLOOR)
    if "token" not in entry and "token_id" in entry:
        token = tokens.decode(entry["token_id"])
        raw_bytes = list(token.encode("utf-8", errors="replace"))
    else:
        token, raw_bytes = entry.get("token"), entry.get("bytes")
    if not isinstance(token, str):
        raise ValueError(f"have token {token!r:.40}")
    if type(logprob) not in (int, float) or math.isnan(logprob) or logprob == math.inf:
        raise ValueError(f"have logprob {logprob!r:.40}")
    if raw_bytes is not None and not (
        isinstance(raw_bytes, list) and all(type(b) is int and 0 <= b < 256 for b in raw_bytes)
    ):
        raise ValueError(f"have bytes {raw_bytes!r:.40}")
    return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": raw_bytes}


class LogprobTokens:
    """A 0.32 choice's logprob token ids as the strings vLLM's chat route gives them (its
    `bytes` are their UTF-8 with errors replaced: chat_completion/serving.py `_get_top_logprobs`).
    vLLM's LogprobsProcessor decodes each id alone (`tokenizer.decode([id])`, special tokens kept:
    tokenizers/detokenizer_utils.py `convert_ids_list_to_tokens`), then a string ending in U+FFFD
    (part of a UTF-8 sequence) is decoded again after up to 4 of the position's preceding sampled
    ids, giving what they complete, or "" while the sequence is still open (v1/engine/logprobs.py
    `_verify_tokens`, `_correct_decoded_token`, vllm 0.32.0). Not done: that function's leading
    spaces restored for a SentencePiece (Metaspace) vocabulary."""

    CONTEXT = 4  # _get_sampled_context_ids' max_context

    def __init__(self, renderer: Renderer) -> None:
        self._renderer = renderer
        self._context: list[int] = []

    def _text(self, ids: list[int]) -> str:
        return self._renderer.detokenize(ids, skip_special_tokens=False)

    def decode(self, token_id: object) -> str:
        if type(token_id) is not int:
            raise ValueError(f"have token_id {token_id!r:.40}")
        text = self._text([token_id])
        return self._corrected(token_id) if text.endswith("\ufffd") else text

    def sampled(self, token_id: object) -> None:
        """After a position: its sampled id is context for the next ones."""
        if type(token_id) is int:
            self._context = [*self._context, token_id][-self.CONTEXT :]

    def _corrected(self, token_id: int) -> str:
        for n in range(1, len(self._context) + 1):
            context = self._context[-n:]
            full = self._text([*context, token_id])
            if full.endswith("\ufffd"):
                continue
            # context ids that were part of this sequence gave "" then: their text is this token's
            clean_end = len(context)
            while clean_end > 0 and self._text([context[clean_end - 1]]).endswith("\ufffd"):
                clean_end -= 1
            prefix = self._text(context[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def completion(ctx: RequestContext, result: GenerateResponse, renderer: Renderer, engine: Engine) -> dict[str, Any]:
    """The OpenAI body of a non-streaming request (with vLLM's `token_ids` per choice), from
    `engine`'s answer."""
    skip = ctx.request.skip_special_tokens
    choices = []
    for c in result.choices:
        with engine_tokens(engine):  # stepped as a stream is: vLLM's text, an open UTF-8 tail left out
            content = renderer.detokenizer(skip_special_tokens=skip).push(c.token_ids)
        choice: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", "content": content},
            "finish_reason": c.finish_reason or "stop",
            "token_ids": c.token_ids,
        }
        if c.logprobs is not None:
            choice["logprobs"] = client_logprobs(c.logprobs, engine, LogprobTokens(renderer), ctx.request.top_logprobs)
        choices.append(choice)
    return completion_body(
        completion_id=ctx.completion_id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        prompt_tokens=len(ctx.token_ids),
    )


class StreamTranslator:
    """One stream's PD payloads -> client SSE frames. Feed every payload to `translate`;
    at the end, `closing_usage` gives the usage chunk the PD did not send, if one is due.

    It also keeps what the relay judges the stream by: `progress` (token ids and finish
    reasons seen: what the gap timeout waits for), `complete` (every choice that started
    has finished), `engine_error` (the PD's own error frame, never relayed: the router
    writes its own) and `malformed` (payloads skipped: not JSON, not an object, or fields
    of the wrong type; and usage chunks whose counts the router replaced with its own)."""

    def __init__(self, ctx: RequestContext, renderer: Renderer, engine: Engine) -> None:
        self._ctx = ctx
        self._renderer = renderer
        self._engine = engine
        self._include_usage = ctx.request.include_usage
        self._skip_special = ctx.request.skip_special_tokens
        # chunks carry the PD's logprobs when the client asked, as the completion does (vLLM
        # 0.24.0 chat_completion/serving.py: every stream choice gets `logprobs=` then)
        self._logprobs = bool(ctx.request.logprobs)
        self._detokenizers: dict[int, DetokenizerLike] = {}
        self._logprob_tokens: dict[int, LogprobTokens] = {}  # per choice: 0.32's ids decoded in context
        self._finished: set[int] = set()
        self._usage_sent = False
        self.progress = 0
        self.malformed = 0
        self.engine_error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return self._ctx.completion_tokens

    @property
    def complete(self) -> bool:
        return bool(self._detokenizers) and self._finished.issuperset(self._detokenizers)

    def translate(self, payload: bytes) -> bytes | None:
        """The client frame for one PD payload, or None when it carries nothing to send."""
        try:
            doc = json.loads(payload)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self.malformed += 1
            return None
        if doc.get("error") and not doc.get("choices"):
            err = doc["error"]
            message = err.get("message") if isinstance(err, dict) else err
            self.engine_error = " ".join(str(message).split())[:200]
            return None
        raw_choices = doc.get("choices") or []
        if not (isinstance(raw_choices, list) and all(_valid_choice(c) for c in raw_choices)):
            self.malformed += 1
            return None
        choices = [self._delta(c) for c in raw_choices]
        if choices:
            return self._chunk(choices)
        if doc.get("usage") and self._include_usage and not self._usage_sent:
            self._usage_sent = True
            usage = _valid_usage(doc["usage"])
            if usage is None:  # not numbers the client could trust (NaN would not even be JSON)
                self.malformed += 1
                usage = self._counted_usage()
            return self._chunk([], usage=usage)
        return None

    def closing_usage(self) -> bytes | None:
        """Our own usage chunk when the client asked for one and the PD sent none."""
        if not self._include_usage or self._usage_sent:
            return None
        self._usage_sent = True
        return self._chunk([], usage=self._counted_usage())

    def _counted_usage(self) -> dict[str, int]:
        """Usage from what the router counted: the prompt it rendered, the ids it relayed."""
        prompt = len(self._ctx.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self._ctx.completion_tokens,
            "total_tokens": prompt + self._ctx.completion_tokens,
        }

    def _delta(self, choice: dict[str, Any]) -> dict[str, Any]:
        index = int(choice.get("index", 0))
        delta: dict[str, Any] = {}
        detokenizer = self._detokenizers.get(index)
        if detokenizer is None:  # the choice's first chunk also names the role
            detokenizer = self._detokenizers[index] = self._renderer.detokenizer(skip_special_tokens=self._skip_special)
            delta["role"] = "assistant"
        new_ids = choice.get("token_ids") or []
        self._ctx.completion_tokens += len(new_ids)
        finish = choice.get("finish_reason")
        if new_ids or finish is not None:
            self.progress += 1
        if finish is not None:
            self._finished.add(index)
        with engine_tokens(self._engine):
            text = detokenizer.push(new_ids)
        if text:
            delta["content"] = text
        if not self._logprobs:
            return {"index": index, "delta": delta, "finish_reason": finish}
        tokens = self._logprob_tokens.setdefault(index, LogprobTokens(self._renderer))
        logprobs = client_logprobs(choice.get("logprobs"), self._engine, tokens, self._ctx.request.top_logprobs)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        ctx = self._ctx
        body = chunk_body(
            completion_id=ctx.completion_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            include_usage=self._include_usage,
            usage=usage,
        )
        return sse_frame(body)


def _valid_usage(usage: object) -> dict[str, int] | None:
    """A PD's usage as the client gets it (the three OpenAI counts), or None unless each is a
    non-negative integer (not a bool, float, NaN or string) and the total adds up."""
    if not isinstance(usage, dict):
        return None
    counts = {name: usage.get(name) for name in USAGE_FIELDS}
    if not all(type(n) is int and n >= 0 for n in counts.values()):
        return None
    if counts["total_tokens"] != counts["prompt_tokens"] + counts["completion_tokens"]:  # type: ignore[operator]
        return None
    return counts  # type: ignore[return-value]


def _valid_choice(choice: object) -> bool:
    """A PD stream choice the translator can use: an object whose index, token ids and
    finish reason have their types (anything else is a malformed frame, not a
    traceback)."""
    if not isinstance(choice, dict):
        return False
    index = choice.get("index", 0)
    ids = choice.get("token_ids") or []
    finish = choice.get("finish_reason")
    return (
        type(index) is int
        and 0 <= index < 128
        and isinstance(ids, list)
        and all(type(t) is int for t in ids)
        and (finish is None or isinstance(finish, str))
    )
