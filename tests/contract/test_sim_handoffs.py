"""The sim speaks upstream vLLM >= 0.30's hand-off when it answers as 0.32 (EPD_SIM_VLLM, a
vllm-cpu fleet's epd_vllm_cpu_vllm): its VE answers a top-level `ec_transfer_params` with a null
`kv_transfer_params`, its PD reads the items from its request's top-level `ec_transfer_params`
and dies, as the real one does, on an image item without an entry; `/inference/v1/generate` is
served only with `--enable-scale-out`, which a 0.24/0.29 sim refuses as their argparsers do
(docs/sim.md "Hand-offs"). Over real HTTP between real processes on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from sim_harness import PD_CORES, VE_CORES, Launcher, Pair, engine_env, free_port, pd_argv, start_pair, start_pd

from epd_kit import plan
from epd_kit.sim.client import build_prompt, fake_image, pd_body, ve_body
from epd_kit.sim.errors import ENGINE_DEAD_MESSAGE
from epd_kit.sim.model import expected_tokens
from epd_kit.sim.release import SCALE_OUT_DISABLED
from epd_kit.wire import EC_TRANSFER_PARAMS, GenerateResponse
from tests.budget import scaled

UPSTREAM = "0.32"
SCALE_OUT = (plan.PREFIX_CACHING_OFF, "--enable-scale-out")
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def pair_032(session_launcher: Launcher, checkpoint) -> Pair:
    return start_pair(
        session_launcher,
        str(checkpoint.path),
        ve_kw={"extra_flags": SCALE_OUT},
        pd_kw={"extra_flags": SCALE_OUT},
        ve_env=engine_env(VE_CORES, vllm=UPSTREAM),
        pd_env=engine_env(PD_CORES, vllm=UPSTREAM),
    )


def _encode(url: str, images) -> dict:
    r = httpx.post(url + GENERATE, json=ve_body(images), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_0_32_ve_answers_ec_transfer_params_and_its_pd_reads_them(pair_032: Pair, checkpoint, image_token_id):
    a = fake_image((1, 8, 8), 71, checkpoint.vision)
    b = fake_image((1, 8, 16), 72, checkpoint.vision)
    body = _encode(pair_032.ve.url, [a, b])  # a VE body holds each item once (§2.2)
    # vLLM 0.32.0 GenerateResponseBase: the EC connector's request_finished result on top, no
    # kv_transfer_params; one entry per mm_hash with its indices in the VE's request (utils.py
    # collect_ec_item_metadata) and the producer's address (cpu/scheduler request_finished)
    assert body["kv_transfer_params"] is None
    entries = body["ec_transfer_params"]
    assert set(entries) == {a.mm_hash, b.mm_hash}
    assert entries[a.mm_hash]["item_indices"] == [0] and entries[b.mm_hash]["item_indices"] == [1]
    for entry in entries.values():
        assert set(entry) == {"item_indices", "metadata", "peer_host", "peer_port", "size_bytes", "shape"}
        assert (entry["peer_host"], entry["peer_port"]) == ("127.0.0.1", pair_032.side_port)
    assert entries[a.mm_hash]["shape"][0] == a.num_tokens
    assert GenerateResponse.model_validate(body).handoff(EC_TRANSFER_PARAMS)[a.mm_hash].readable

    prompt, phs = build_prompt([a, b, a], image_token_id)
    request = pd_body(prompt, [a, b, a], phs, entries, max_tokens=8, ignore_eos=True, handoff=EC_TRANSFER_PARAMS)
    assert (
        request["ec_transfer_params"] == entries
        and "kv_transfer_params" not in request["sampling_params"]["extra_args"]
    )
    r = httpx.post(pair_032.pd.url + GENERATE, json=request, timeout=10)
    assert r.status_code == 200, r.text
    # the PD's tokens follow the embedding bytes it read from the VE by mm_hash
    want = expected_tokens(prompt, [a.mm_hash, b.mm_hash, a.mm_hash], 8, checkpoint.vocab, ignore_eos=True)
    assert r.json()["choices"][0]["token_ids"] == list(want.token_ids)
    assert "Got kv_transfer_params" not in pair_032.pd.log()  # nothing rode in kv_transfer_params


def test_a_0_32_pd_dies_on_an_image_without_ec_transfer_params(launcher: Launcher, checkpoint, image_token_id):
    """What issue 54 saw of a real 0.32 PD given an LM-only request: its engine core dies. The
    observable part, as for every dead engine core: the request and every later one get
    EngineDeadError's 500, /health 503, the process exits 0; only the log names the cause."""
    pd = start_pd(launcher, str(checkpoint.path), engine_env(PD_CORES, vllm=UPSTREAM), extra_flags=SCALE_OUT)
    a = fake_image((1, 8, 8), 73, checkpoint.vision)
    prompt, phs = build_prompt([a], image_token_id)
    request = pd_body(prompt, [a], phs, {}, max_tokens=4, handoff=EC_TRANSFER_PARAMS)
    assert "ec_transfer_params" not in request
    dead = {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}
    r = httpx.post(pd.url + GENERATE, json=request, timeout=10)
    assert (r.status_code, r.json()["error"]) == (500, dead)
    text = pd_body([1, 2, 3], [], [], {}, max_tokens=2, handoff=EC_TRANSFER_PARAMS)
    later = httpx.post(pd.url + GENERATE, json=text, timeout=10)
    assert (later.status_code, later.json()["error"]) == (500, dead)
    assert httpx.get(pd.url + "/health", timeout=2).status_code == 503
    assert pd.wait_exit(10) == 0
    assert "Expected number of multimodal embeddings to match number of input items: 1" in pd.log()


def test_a_0_32_engine_serves_the_route_only_with_enable_scale_out(launcher: Launcher, checkpoint):
    """vLLM 0.32.0 entrypoints/scale_out/factories.py: without the flag every scale-out route
    answers 403 PermissionDeniedError; the engine is otherwise up."""
    pd = start_pd(launcher, str(checkpoint.path), engine_env(PD_CORES, vllm=UPSTREAM))
    r = httpx.post(pd.url + GENERATE, json=pd_body([1, 2, 3], [], [], {}, max_tokens=2), timeout=10)
    assert r.status_code == 403
    assert r.json()["error"] == {
        "message": SCALE_OUT_DISABLED,
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
    assert httpx.get(pd.url + "/health", timeout=2).status_code == 200


@pytest.mark.parametrize("vllm", ["0.24", "0.29"])
def test_a_sim_answering_as_an_older_vllm_refuses_enable_scale_out(checkpoint, vllm):
    """The flag came with vLLM 0.30.0 (plan/neuron_releases.py SERVE_FLAGS): an older argparser stops."""
    argv = [
        sys.executable,
        "-m",
        "epd_kit.sim.cli",
        *pd_argv(str(checkpoint.path), free_port(), extra_flags=SCALE_OUT)[1:],
    ]
    result = subprocess.run(
        argv, env=engine_env(PD_CORES, vllm=vllm), capture_output=True, text=True, timeout=scaled(60), check=False
    )
    assert result.returncode != 0
    assert "unrecognized arguments: --enable-scale-out" in result.stderr + result.stdout


def test_a_0_32_pd_that_cannot_read_an_announced_item_fails_that_request_only(
    pair_032: Pair, checkpoint, image_token_id
):
    """An entry with the producer's address whose read fails (here: the VE never held the item):
    upstream's consumer fails the request (FINISHED_ERROR, vLLM 0.32.0 ec_connector/cpu/scheduler
    _fail_or_fallback: Qwen3-VL's image_grid_thw is placeholder metadata, no pixels to encode)
    and the engine stays up: vLLM's generation error, 500 "Internal server error" (release.py)."""
    a = fake_image((1, 8, 8), 74, checkpoint.vision)
    entry = {
        "item_indices": [0],
        "metadata": {"image_grid_thw": [1, 8, 8]},
        "peer_host": "127.0.0.1",
        "peer_port": pair_032.side_port,
        "size_bytes": 4096,
        "shape": [a.num_tokens, 8],
    }
    prompt, phs = build_prompt([a], image_token_id)
    request = pd_body(prompt, [a], phs, {a.mm_hash: entry}, max_tokens=4, handoff=EC_TRANSFER_PARAMS)
    r = httpx.post(pair_032.pd.url + GENERATE, json=request, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["message"] == "Internal server error", r.text
    assert httpx.get(pair_032.pd.url + "/health", timeout=2).status_code == 200
    assert f"needs remote encoding mm_hash={a.mm_hash}" in pair_032.pd.log()
    # and it serves the next request
    body = _encode(pair_032.ve.url, [a])
    ok = pd_body(prompt, [a], phs, body["ec_transfer_params"], max_tokens=4, handoff=EC_TRANSFER_PARAMS)
    assert httpx.post(pair_032.pd.url + GENERATE, json=ok, timeout=10).status_code == 200
