"""Two models behind one router process, on real `epd-sim` engines: a vision model ("vision": one
VE + one PD) and a text-only model ("text": one PD of its own). The openai client gets each
model's own answer (the sim's pure model, over the router's rendering) from that model's own
engines; an unknown model is OpenAI's 404; a reload moves one model's pools without touching the
other's; and vLLM's own benchmark client (`vllm bench serve`, vllm 0.24.0 from the compat env)
runs against each model."""

from __future__ import annotations

import re

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message
from epd_kit.testing.process import stop_all
from tests.vllm_dist import bench_serve

from .harness import SimEngine, Stack, wait_until


@pytest.fixture(scope="module")
def two(ckpt, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two-models")
    text_pd = SimEngine("pd", "epd-text-pd-0", ckpt, workdir).start()
    try:
        text_pd.wait_healthy()
        stack = Stack.start(
            ckpt,
            workdir,
            n_ve=1,
            n_pd=1,
            served_model_name="vision",
            models=[{"name": "text", "model": str(ckpt)}],
            endpoints={"models": {"text": {"text_only": True, "pd": [{"id": "epd-text-pd-0", "url": text_pd.url}]}}},
        )
    except BaseException:
        stop_all([text_pd.process])
        raise
    yield stack, text_pd
    stack.stop()
    stop_all([text_pd.process])


def client_of(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.router.url}/v1", api_key="none", timeout=30, max_retries=0)


def test_each_model_answers_from_its_own_engines(two, oracle):
    stack, _ = two
    client = client_of(stack)
    assert [m.id for m in client.models.list().data] == ["vision", "text"]
    before = {i: e["served"] for i, e in stack.router.pools().items()}
    vision = [user_message("Describe this image.", image_part(png_data_url(96, 64, seed=3)))]
    answer = client.chat.completions.create(model="vision", messages=vision, max_tokens=6)
    assert answer.model == "vision" and answer.choices[0].message.content == oracle.expect(vision, 6)[3]
    text = [user_message("Say hello.")]
    answer = client.chat.completions.create(model="text", messages=text, max_tokens=6)
    assert answer.model == "text" and answer.choices[0].message.content == oracle.expect(text, 6)[3]
    after = stack.router.pools()
    served = {i: after[i]["served"] - before[i] for i in after}
    assert served == {"epd-ve-0": 1, "epd-pd-0": 1, "epd-text-pd-0": 1}
    assert {i: e["model"] for i, e in after.items()} == {
        "epd-ve-0": "vision",
        "epd-pd-0": "vision",
        "epd-text-pd-0": "text",
    }


def test_unknown_model_is_openai_404_and_text_model_refuses_images(two):
    from openai import BadRequestError, NotFoundError

    stack, _ = two
    client = client_of(stack)
    with pytest.raises(NotFoundError) as refused:
        client.chat.completions.create(model="nope", messages=[user_message("hi")], max_tokens=2)
    assert refused.value.body["code"] == "model_not_found" and refused.value.body["type"] == "invalid_request_error"
    image = [user_message("What is this?", image_part(png_data_url(64, 64)))]
    with pytest.raises(BadRequestError, match="text-only"):
        client.chat.completions.create(model="text", messages=image, max_tokens=2)
    ready = httpx.get(stack.router.url + "/ready", params={"model": "text"}, timeout=5, trust_env=False)
    assert ready.json() == {"ready": True}


def test_a_reload_drains_one_models_engine_and_leaves_the_other(two):
    stack, text_pd = two
    cfg = {**stack.config}
    cfg["endpoints"] = {
        **stack.config["endpoints"],
        "models": {
            "text": {"text_only": True, "pd": [{"id": "epd-text-pd-0", "url": text_pd.url, "state": "draining"}]}
        },
    }
    stack.router.write_config(cfg)
    stack.router.reload()
    try:
        wait_until(lambda: stack.router.pools()["epd-text-pd-0"]["state"] == "draining", 10, "text's PD draining")
        ready = httpx.get(stack.router.url + "/ready", params={"model": "text"}, timeout=5, trust_env=False)
        assert ready.status_code == 503 and "no healthy active PD" in ready.json()["reason"]
        assert httpx.get(stack.router.url + "/ready", params={"model": "vision"}, timeout=5).status_code == 200
        assert stack.router.pools()["epd-pd-0"]["state"] == "active"
    finally:
        stack.router.write_config(stack.config)
        stack.router.reload()
        wait_until(lambda: stack.router.pools()["epd-text-pd-0"]["state"] == "active", 10, "text's PD active again")


BENCH_PROMPTS = 20


@pytest.fixture(scope="module")
def bench_runs(two, ckpt, vllm_process):
    """Both models' `vllm bench serve` runs, one after the other in the session's vLLM process
    (conftest.py `vllm_process`: each process imports vLLM again, ~11 CPU-s)."""
    stack, _ = two
    vllm = vllm_process()
    if vllm is None:
        pytest.skip("the vLLM-compat venv is not built (yet): scripts/compat-env.sh --vllm 0.24.0 builds it")
    images = {"vision": True, "text": False}
    return bench_serve(vllm, stack.router.url, str(ckpt), BENCH_PROMPTS, images=images, cwd=stack.workdir)


@pytest.mark.parametrize("model", ["vision", "text"])
def test_vllm_bench_serve_runs_against_each_model(bench_runs, model):
    """vLLM's own benchmark client (vllm 0.24.0's `vllm bench serve`, openai-chat backend): the
    vision model with one random image per request (random-mm), the text model with text
    (random); every request succeeds."""
    status, summary, stderr = bench_runs[model]
    print(f"vllm bench serve --model {model} (exit {status}):\n{summary}")
    assert status == 0, stderr
    assert re.search(rf"Successful requests:\s+{BENCH_PROMPTS}\b", summary), summary
    assert re.search(r"Failed requests:\s+0\b", summary), summary
