"""The simulated engine answers as the vLLM its unit names (EPD_SIM_VLLM, set from the fleet's Neuron
release): 0.29's answers differ from 0.24's as docs/compat.md "vLLM 0.24 vs 0.29 on the kit's
wire" says, over real HTTP; an unknown version stops the engine at start."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from sim_harness import PD_CORES, VE_CORES, Launcher, Pair, engine_env, free_port, pd_argv, start_pair

from epd_kit.sim.client import build_prompt, fake_image, pd_body, ve_body
from epd_kit.wire import GenerateResponse, split_sse, sse_data
from tests.budget import scaled


@pytest.fixture(scope="module")
def pair_029(session_launcher: Launcher, checkpoint) -> Pair:
    return start_pair(
        session_launcher,
        str(checkpoint.path),
        ve_env=engine_env(VE_CORES, vllm="0.29"),
        pd_env=engine_env(PD_CORES, vllm="0.29"),
    )


def test_a_0_29_engine_answers_with_0_29s_fields(pair_029: Pair, checkpoint, image_token_id) -> None:
    a = fake_image((1, 8, 8), 61, checkpoint.vision)
    before = int(time.time())
    ve = httpx.post(pair_029.ve.url + "/inference/v1/generate", json=ve_body([a]), timeout=10)
    assert ve.status_code == 200, ve.text
    body = ve.json()
    # 0.29 serving.py serve_tokens_full_generator: the caller's id, model, created, usage
    assert body["request_id"] == f"generate-tokens-{ve_body([a])['request_id']}"
    assert body["model"] and body["created"] >= before and body["ec_transfer_params"] is None
    # 0.29's encoder-only engine samples nothing: it stops once the prompt is encoded (release.py ve_finish)
    assert body["usage"]["prompt_tokens"] == a.num_tokens and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["sampling_mask"] is None
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["token_ids"] == []
    locs = GenerateResponse.model_validate(body).ec_locators()  # the locators where 0.24 has them
    assert set(locs) == {a.mm_hash}

    prompt, phs = build_prompt([a], image_token_id)
    request = pd_body(prompt, [a], phs, locs, max_tokens=8, ignore_eos=True)
    pd = httpx.post(pair_029.pd.url + "/inference/v1/generate", json=request, timeout=10).json()
    assert pd["request_id"] == f"generate-tokens-{request['request_id']}"
    assert pd["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + 8,
        "completion_tokens": 8,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert len(pd["choices"][0]["token_ids"]) == 8 and pd["choices"][0]["sampling_mask"] is None

    stream = pd_body(prompt, [a], phs, locs, max_tokens=4, stream=True, include_usage=True, ignore_eos=True)
    raw = httpx.post(pair_029.pd.url + "/inference/v1/generate", json=stream, timeout=10).content
    docs = [json.loads(p) for p in (sse_data(e) for e in split_sse(raw)[0]) if p != b"[DONE]"]
    token_docs = [d for d in docs if d["choices"]]
    assert token_docs and all(d["choices"][0]["sampling_mask"] is None for d in token_docs)
    assert next(d for d in docs if not d["choices"])["usage"]["completion_tokens"] == 4


def test_a_0_24_engine_keeps_0_24s_answer(pair: Pair, checkpoint) -> None:
    a = fake_image((1, 8, 8), 62, checkpoint.vision)
    body = httpx.post(pair.ve.url + "/inference/v1/generate", json=ve_body([a]), timeout=10).json()
    assert not {"model", "created", "usage", "ec_transfer_params"} & set(body)
    assert "sampling_mask" not in body["choices"][0]
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["token_ids"] == [0]


def test_an_unknown_vllm_stops_the_engine_at_start(checkpoint) -> None:
    env = engine_env(PD_CORES, vllm="0.31")
    argv = [sys.executable, "-m", "epd_kit.sim.cli", *pd_argv(str(checkpoint.path), free_port())[1:]]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=scaled(60), check=False)
    assert result.returncode != 0
    said = result.stderr + result.stdout
    assert "EPD_SIM_VLLM='0.31': the simulated engine answers as vLLM 0.24, 0.29 or 0.32" in said


# vLLM's per-request generation error (GenerationError through create_error_response), the same
# body in both releases; docs/compat.md "Generation errors" has the source lines
GENERATION_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}


def _text_body(stream: bool) -> dict:
    return {
        "request_id": f"gen-err-{int(stream)}",
        "token_ids": [5, 6, 7, 8],
        "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
        "sampling_params": {"max_tokens": 8, "ignore_eos": True},
        "stream": stream,
    }


def _set_faults(url: str, **faults: object) -> None:
    r = httpx.put(url + "/sim/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("vllm", ["0.24", "0.29"])
def test_a_failed_generation_has_its_vllms_shape_and_the_engine_stays_up(vllm: str, pair: Pair, pair_029: Pair) -> None:
    """0.24: 200 with the "error" choice (serve/disagg/serving.py:292); 0.29: the route's 500
    (token_in_token_out/serving.py:305); a stream, both: the tokens before, the error event,
    [DONE]. /health stays 200 and the next request is served."""
    pd = (pair if vllm == "0.24" else pair_029).pd
    gen = pd.url + "/inference/v1/generate"
    try:
        _set_faults(pd.url, generation_error_rate=1.0, generation_error_after=3)
        r = httpx.post(gen, json=_text_body(stream=False), timeout=10)
        if vllm == "0.24":
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "error" and len(choice["token_ids"]) == 3
        else:
            assert r.status_code == 500 and r.json() == {"error": GENERATION_ERROR}
        raw = httpx.post(gen, json=_text_body(stream=True), timeout=10).content
        payloads = [sse_data(e) for e in split_sse(raw)[0]]
        assert payloads[-1] == b"[DONE]"
        docs = [json.loads(p) for p in payloads[:-1]]
        assert docs[-1] == {"error": GENERATION_ERROR}
        assert sum(len(d["choices"][0]["token_ids"]) for d in docs[:-1]) == 3
        assert all(d["choices"][0]["finish_reason"] is None for d in docs[:-1])
        _set_faults(pd.url, generation_error_rate=1.0)  # generation_error_after 0: before any token
        first = [sse_data(e) for e in split_sse(httpx.post(gen, json=_text_body(True), timeout=10).content)[0]]
        assert [json.loads(first[0]), first[1]] == [{"error": GENERATION_ERROR}, b"[DONE]"]
        metrics = httpx.get(pd.url + "/metrics", timeout=5).text
        assert 'kind="generation_error"' in metrics
    finally:
        _set_faults(pd.url)
    assert httpx.get(pd.url + "/health", timeout=5).status_code == 200
    ok = httpx.post(gen, json=_text_body(stream=False), timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
