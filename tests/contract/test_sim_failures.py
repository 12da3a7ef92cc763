"""Every documented failure mode (tutorial "Common issues", docs/contract.md §7.2) reproduced by the
sim, with its message and its exit behaviour."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sim_harness import (
    PD_CORES,
    VE_CORES,
    Launcher,
    Pair,
    engine_env,
    free_port,
    pd_argv,
    port_open,
    start_pair,
    start_pd,
    ve_argv,
)

from epd_kit.sim.client import build_prompt, fake_image, pd_body, ve_body
from epd_kit.sim.errors import ENGINE_DEAD_MESSAGE
from epd_kit.sim.model import expected_tokens
from epd_kit.wire import GenerateResponse, split_sse, sse_data


def _encode(url: str, images) -> dict:
    r = httpx.post(url + "/inference/v1/generate", json=ve_body(images), timeout=10)
    assert r.status_code == 200, r.text
    return GenerateResponse.model_validate(r.json()).ec_locators()


def _engine_dead(r: httpx.Response) -> bool:
    """vLLM's answer once its engine core died, whatever the cause (docs/sim.md "Real vLLM")."""
    return r.status_code == 500 and r.json()["error"] == {
        "message": ENGINE_DEAD_MESSAGE,
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }


def _assert_died(pd, log_markers: list[str]) -> None:
    """PD engine core died: 503 on /health, then the process exits 0 as vLLM's API server
    does; only the log says why."""
    assert httpx.get(pd.url + "/health", timeout=2).status_code == 503
    assert pd.wait_exit(10) == 0
    log = pd.log()
    for marker in log_markers:
        assert marker in log, f"{marker!r} not in log:\n{log}"


# --- startup failures -------------------------------------------------------------------


def test_tp_not_equal_to_visible_cores_asserts_at_startup(launcher: Launcher, checkpoint) -> None:
    port = free_port()
    eng = launcher.start(pd_argv(str(checkpoint.path), port), engine_env("0,1,2,3"))
    assert eng.wait_exit() == 1
    assert "AssertionError: TP (8) != len(NEURON_VISIBLE_DEVICES) (4)" in eng.log()
    assert "Uvicorn running" not in eng.log() and not port_open(port)


def test_misaligned_slice_compiles_then_fails_in_warmup(launcher: Launcher, checkpoint) -> None:
    port = free_port()
    eng = launcher.start(pd_argv(str(checkpoint.path), port), engine_env("4,5,6,7,8,9,10,11"))
    assert eng.wait_exit() == 1
    log = eng.log()
    compiled = log.index("Compilation finished")
    assert log.index("Collective operation REDUCE_SCATTER") > compiled
    assert "Failed to schedule neff execution. status=2 message=Invalid" in log
    assert "Model warmup failed for prefill bucket 8192" in log
    assert "Uvicorn running" not in log and not port_open(port)


def test_both_build_roles_is_a_value_error(launcher: Launcher, checkpoint) -> None:
    argv = pd_argv(str(checkpoint.path), free_port()) + ["--mm-encoder-only"]
    eng = launcher.start(argv, engine_env(PD_CORES))
    assert eng.wait_exit() == 1
    assert "ValueError: mm_encoder_only and mm_language_model_only are mutually exclusive" in eng.log()


TYPE_ERROR = "TypeError: {arch}.from_configs() got an unexpected keyword argument 'text_neuron_config'"


@pytest.mark.parametrize("model", ["", None, "/nonexistent/Qwen3-VL-32B-Instruct"])
def test_empty_or_missing_model_falls_back_to_text_only_default(launcher: Launcher, model) -> None:
    eng = launcher.start(ve_argv(model, free_port(), free_port()), engine_env(VE_CORES))
    assert eng.wait_exit() == 1
    assert TYPE_ERROR.format(arch="Qwen3ForCausalLM") in eng.log()


def test_text_only_checkpoint_with_vision_config(launcher: Launcher, text_only_checkpoint) -> None:
    eng = launcher.start(ve_argv(str(text_only_checkpoint), free_port(), free_port()), engine_env(VE_CORES))
    assert eng.wait_exit() == 1
    assert TYPE_ERROR.format(arch="Qwen3ForCausalLM") in eng.log()


def test_unknown_flag_is_an_error(launcher: Launcher, checkpoint) -> None:
    argv = pd_argv(str(checkpoint.path), free_port()) + ["--enable-magic"]
    eng = launcher.start(argv, engine_env(PD_CORES))
    assert eng.wait_exit() == 2
    assert "unrecognized arguments: --enable-magic" in eng.log()


# --- runtime failures ---------------------------------------------------------------------


@pytest.mark.parametrize("side", ["ve", "pd"])
def test_missing_efa_env_times_out_the_read_and_kills_pd(
    launcher: Launcher, pair: Pair, checkpoint, image_token_id, side
) -> None:
    model = str(checkpoint.path)
    if side == "ve":  # both engines come up healthy: nothing complains before a request
        broken = start_pair(launcher, model, ve_env=engine_env(VE_CORES, efa=False))
        ve_url, pd = broken.ve.url, broken.pd
    else:
        ve_url, pd = pair.ve.url, start_pd(launcher, model, engine_env(PD_CORES, efa=False))
    a = fake_image((1, 8, 8), 61 if side == "ve" else 62, checkpoint.vision)
    locs = _encode(ve_url, [a])
    prompt, phs = build_prompt([a], image_token_id)
    t0 = time.monotonic()
    r = httpx.post(pd.url + "/inference/v1/generate", json=pd_body(prompt, [a], phs, locs), timeout=10)
    assert time.monotonic() - t0 >= 0.9  # transfer_timeout_sec defaults to 1 s
    assert _engine_dead(r)
    _assert_died(
        pd,
        ["EC wait_for_load timed out after 1.00 s", f"Encoder-cache load failed for mm_hashes: ['{a.mm_hash}']"],
    )
    assert httpx.get(ve_url + "/health").status_code == 200  # the VE is not the one dying


def test_oversized_image_fails_to_encode_on_the_ve(pair: Pair, checkpoint) -> None:
    big = fake_image((1, 34, 32), 71, checkpoint.vision)  # 1088 patches > 1024
    r = httpx.post(pair.ve.url + "/inference/v1/generate", json=ve_body([big]), timeout=10)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "1088 patches" in msg and "vision_attention_block_size=1024" in msg
    assert "Failed to encode image" in pair.ve.log()
    assert httpx.get(pair.ve.url + "/health").status_code == 200
    ok = fake_image((1, 32, 32), 72, checkpoint.vision)  # exactly 1024 patches is fine
    assert httpx.post(pair.ve.url + "/inference/v1/generate", json=ve_body([ok]), timeout=10).status_code == 200


def test_block_size_disagreement_fails_the_handshake(
    launcher: Launcher, pair: Pair, checkpoint, image_token_id
) -> None:
    pd = start_pd(launcher, str(checkpoint.path), vab=2048)  # the VE has 1024
    a = fake_image((1, 8, 8), 81, checkpoint.vision)
    locs = _encode(pair.ve.url, [a])
    prompt, phs = build_prompt([a], image_token_id)
    r = httpx.post(pd.url + "/inference/v1/generate", json=pd_body(prompt, [a], phs, locs), timeout=10)
    assert _engine_dead(r)
    _assert_died(
        pd,
        [
            "EC region block_len mismatch: remote engine epd-ve-0 advertises "
            "131072 bytes/block, local region has 262144 bytes/block"
        ],
    )


def test_prefix_caching_left_on_gives_wrong_output_silently(
    launcher: Launcher, pair: Pair, checkpoint, image_token_id
) -> None:
    # PD started without --no-enable-prefix-caching: vLLM's default (on) applies.
    pd = start_pd(launcher, str(checkpoint.path), extra_flags=())
    a = fake_image((1, 16, 16), 91, checkpoint.vision)
    b = fake_image((1, 16, 16), 92, checkpoint.vision)  # same size: same prompt tokens
    prompt, phs = build_prompt([a], image_token_id)
    answers = []
    for im in (a, a, b):
        locs = _encode(pair.ve.url, [im])
        r = httpx.post(
            pd.url + "/inference/v1/generate",
            timeout=10,
            json=pd_body(prompt, [im], phs, locs, max_tokens=16, ignore_eos=True),
        )
        assert r.status_code == 200  # no error anywhere...
        answers.append(tuple(r.json()["choices"][0]["token_ids"]))
    want_a = expected_tokens(prompt, [a.mm_hash], 16, checkpoint.vocab, ignore_eos=True)
    want_b = expected_tokens(prompt, [b.mm_hash], 16, checkpoint.vocab, ignore_eos=True)
    assert answers[0] == answers[1] == want_a.token_ids
    assert answers[2] != want_b.token_ids  # ...but image B gets a wrong answer
    assert httpx.get(pd.url + "/health").status_code == 200
    # An image wholly inside the cached prefix is not even read: B gets A's exact answer.
    long_prompt = prompt + [11] * 64
    for im, want in ((a, a), (b, a)):
        locs = _encode(pair.ve.url, [im])
        r = httpx.post(
            pd.url + "/inference/v1/generate",
            timeout=10,
            json=pd_body(long_prompt, [im], phs, locs, max_tokens=8, ignore_eos=True),
        )
        assert (
            tuple(r.json()["choices"][0]["token_ids"])
            == expected_tokens(long_prompt, [want.mm_hash], 8, checkpoint.vocab, ignore_eos=True).token_ids
        )


def test_missing_locator_is_ec_load_failure(launcher: Launcher, checkpoint, image_token_id) -> None:
    pd = start_pd(launcher, str(checkpoint.path))
    a = fake_image((1, 8, 8), 101, checkpoint.vision)
    prompt, phs = build_prompt([a], image_token_id)
    body = pd_body(prompt, [a], phs, {}, stream=True, include_usage=True)
    with httpx.stream("POST", pd.url + "/inference/v1/generate", json=body, timeout=10) as r:
        assert r.status_code == 200  # headers go out before the load fails...
        raw = b"".join(r.iter_bytes())
    events, _ = split_sse(raw)
    assert [sse_data(e) for e in events][-1] == b"[DONE]"  # ...then an error frame, [DONE]
    error = json.loads(sse_data(events[0]))["error"]
    assert error == {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}
    _assert_died(pd, [f"Encoder-cache load failed for mm_hashes: ['{a.mm_hash}']"])


def test_a_missing_block_fails_every_request_in_flight_and_after_then_exits_0(
    launcher: Launcher, checkpoint, image_token_id
) -> None:
    """As a real vLLM PD whose engine core died (tests/real_engines/test_missing_block.py):
    the request that killed it, a stream in flight (error event, [DONE]) and a request that
    comes before the process exits all get vLLM's EngineDeadError message; it exits 0."""
    pd = start_pd(launcher, str(checkpoint.path), env=engine_env(PD_CORES, decode_ms_per_token="20"))
    gen = pd.url + "/inference/v1/generate"
    text = {
        "token_ids": [5, 6, 7, 8],
        "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True},
    }
    a = fake_image((1, 8, 8), 102, checkpoint.vision)
    prompt, phs = build_prompt([a], image_token_id)
    with httpx.stream("POST", gen, json={**text, "request_id": "long", "stream": True}, timeout=10) as stream:
        chunks = stream.iter_bytes()
        raw = next(chunks)  # generating
        assert _engine_dead(httpx.post(gen, json=pd_body(prompt, [a], phs, {}), timeout=10))
        raw += b"".join(chunks)
    events, _ = split_sse(raw)
    datas = [sse_data(e) for e in events]
    assert datas[-1] == b"[DONE]"
    assert json.loads(datas[-2])["error"]["message"] == ENGINE_DEAD_MESSAGE
    assert _engine_dead(httpx.post(gen, json={**text, "request_id": "after"}, timeout=10))
    _assert_died(pd, [f"Encoder-cache load failed for mm_hashes: ['{a.mm_hash}']"])


def test_evicted_block_is_detected_not_ignored(launcher: Launcher, checkpoint, image_token_id) -> None:
    # A 2-block cache (1 usable + scratch): B evicts A once A's 100 ms hold has passed.
    pair = start_pair(launcher, str(checkpoint.path), ve_kw={"blocks": 2, "max_num_batched_tokens": 256})
    a, b = fake_image((1, 8, 8), 111, checkpoint.vision), fake_image((1, 8, 8), 112, checkpoint.vision)
    locs_a = _encode(pair.ve.url, [a])
    time.sleep(0.15)
    locs_b = _encode(pair.ve.url, [b])
    assert locs_a[a.mm_hash].remote_block_ids == locs_b[b.mm_hash].remote_block_ids
    prompt, phs = build_prompt([a], image_token_id)
    r = httpx.post(pair.pd.url + "/inference/v1/generate", json=pd_body(prompt, [a], phs, locs_a), timeout=10)
    assert _engine_dead(r)
    _assert_died(pair.pd, ["evicted or reused before the read"])
