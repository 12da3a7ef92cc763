"""The OpenAI front refuses what vLLM's own front refuses (router/context_window.py): each body
below goes to the router and to vLLM's own `/v1/chat/completions` on the PD of this run's vLLM
(0.24, 0.29 or 0.32, its real request model, renderer and error handlers; only the engine core is a
stand-in), and both answers must be the same 400: status, message, type, param and code. The
router's answer must come before any engine call.

The checks are the ones vLLM's chat route makes before its engine and its generate route (the
router's) skips: TokenizeParams' output tokens above the context, and its prompt plus output
tokens above it (vllm/renderers/params.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.compat.cases import CHATS
from tests.compat.stack import REQUEST_TIMEOUT_S, CompatStack
from tests.compat.vllm_api import VLLM_SERIES

# vLLM 0.32's front checks differently (renderers/params.py at 0.32.0): TokenizeParams.max_input_tokens
# no longer subtracts the output tokens (a prompt plus max_tokens over the context is served, its
# max_tokens clamped by get_max_tokens), a prompt alone over the context has a message of its own
# ("... exceeds this limit even without any output tokens"), and the output check's message reads
# max_model_len=N (0.24/0.29 print max_model_len=max_total_tokens=N). The router follows the
# fleet's front (router.yaml front_checks, which the stack writes from this run's vLLM): these
# bodies both serve on 0.32.
SERVED_ON_032 = frozenset({"prompt + max_tokens over the context", "max_tokens the whole context"})


@pytest.fixture(scope="module")
def context(stack: CompatStack) -> int:
    """The PD's context (its --max-model-len, the tutorial's), from its own /v1/models."""
    models = httpx.get(stack.pd.url + "/v1/models", timeout=REQUEST_TIMEOUT_S, trust_env=False).json()
    return models["data"][0]["max_model_len"]


def _long_text(stack: CompatStack, tokens: int) -> str:
    """Plain text of at least `tokens` tokens of the checkpoint's tokenizer (one per word here)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(stack.model / "tokenizer.json"))
    text = " ".join(["blue"] * tokens)
    assert len(tokenizer.encode(text).ids) >= tokens
    return text


# body name -> (messages, the fields beside them; "CONTEXT" is replaced by the PD's context)
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "max_tokens over the context": ("text-only", {"max_tokens": 100000}),
    "max_completion_tokens over the context": ("text-only", {"max_completion_tokens": 100000}),
    "both given: max_completion_tokens counts": ("text-only", {"max_tokens": 4, "max_completion_tokens": 100000}),
    "an image chat, max_tokens over the context": ("one-image", {"max_tokens": 100000}),
    "prompt + max_tokens over the context": ("text-only", {"max_tokens": "CONTEXT-2"}),
    "max_tokens the whole context": ("text-only", {"max_tokens": "CONTEXT"}),
    "a prompt longer than the context, no max_tokens": ("long", {}),
}


def _body(stack: CompatStack, name: str, context: int) -> dict[str, Any]:
    chat, fields = BODIES[name]
    messages = [{"role": "user", "content": _long_text(stack, context + 50)}] if chat == "long" else CHATS[chat]
    resolved = {key: _resolve(value, context) for key, value in fields.items()}
    return {"model": str(stack.model), "messages": messages, "temperature": 0.0, **resolved}


def _resolve(value: Any, context: int) -> Any:
    if isinstance(value, str) and value.startswith("CONTEXT"):
        return context + int(value.removeprefix("CONTEXT") or 0)
    return value


@pytest.mark.parametrize("name", BODIES)
def test_the_router_refuses_as_vllm_chat_route(stack: CompatStack, context: int, name: str) -> None:
    body = _body(stack, name, context)
    if VLLM_SERIES == "0.32" and name in SERVED_ON_032:
        _both_serve(stack, body)
        return
    stack.ve.clear()
    stack.pd.clear()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        ours = client.post(stack.router_url + "/v1/chat/completions", json=body)
        engines_saw = stack.ve.generate_bodies() + stack.pd.generate_bodies()
        theirs = client.post(stack.pd.url + "/v1/chat/completions", json=body)
    assert theirs.status_code == 400, theirs.text  # the body is one vLLM's front refuses
    assert ours.status_code == theirs.status_code, ours.text
    assert ours.json()["error"] == theirs.json()["error"]
    assert engines_saw == []  # refused before any engine call
    assert stack.pd.core.requests == [] and stack.ve.core.requests == []


def _both_serve(stack: CompatStack, body: dict[str, Any]) -> None:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        ours = client.post(stack.router_url + "/v1/chat/completions", json=body)
        theirs = client.post(stack.pd.url + "/v1/chat/completions", json=body)
    assert (ours.status_code, theirs.status_code) == (200, 200), (ours.text, theirs.text)


def test_within_the_context_both_serve(stack: CompatStack, context: int) -> None:
    """The edge: prompt + max_tokens exactly the context is served by both."""
    tokens = len(stack.render(CHATS["text-only"], max_tokens=1)["token_ids"])
    body = {
        "model": str(stack.model),
        "messages": CHATS["text-only"],
        "max_tokens": context - tokens,
        "temperature": 0.0,
    }
    _both_serve(stack, body)
