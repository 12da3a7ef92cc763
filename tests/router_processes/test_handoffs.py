"""The router speaks the fleet's hand-off (router.yaml `handoff`, docs/contract.md "Hand-offs"):
vllm-neuron's `kv_transfer_params.ec_locator` with sims answering as vLLM 0.24, upstream's
top-level `ec_transfer_params` with sims answering as 0.32 (started with --enable-scale-out, as
the plan starts such engines). A VE answer without a fetchable entry for an item is that VE's
failure: charged, the item encoded on the other VE, the PD never sent an LM-only request (which
would kill its engine core). Real processes on 127.0.0.1; every loop is bounded."""

from __future__ import annotations

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message

from .harness import Stack

MAX_TOKENS = 12
# (EPD_SIM_VLLM, router.yaml handoff, the engines' extra flags: what the plan gives a 0.3x engine)
FLEETS = {
    "ec_locator": ("0.24", ()),
    "ec_transfer_params": ("0.32", ("--enable-scale-out",)),
}


def _start(ckpt, workdir, handoff: str, n_ve: int, n_pd: int = 1, broken_ve: dict[str, str] | None = None) -> Stack:
    """A fleet of sims answering as `handoff`'s vLLM; `broken_ve`: epd-ve-0's fault settings."""
    vllm, flags = FLEETS[handoff]
    envs = {f"epd-{role}-{i}": {"EPD_SIM_VLLM": vllm} for role, n in (("ve", n_ve), ("pd", n_pd)) for i in range(n)}
    envs["epd-ve-0"].update(broken_ve or {})
    return Stack.start(ckpt, workdir, n_ve=n_ve, n_pd=n_pd, sim_env=envs, engine_args=flags, handoff=handoff)


def _chat(stack: Stack, oracle, seed: int, images: int = 1) -> None:
    """One image chat through the router; its tokens must be the oracle's (the PD read every
    embedding it was meant to, from the VE that encoded it)."""
    urls = [png_data_url(224 + 32 * i, 224, seed=seed + i) for i in range(images)]
    messages = [user_message("Describe.", *(image_part(u) for u in urls))]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    _, tokens, finish, _ = oracle.expect(messages, MAX_TOKENS)
    choice = r.json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"]) == (tokens, finish)


@pytest.fixture(scope="module", params=list(FLEETS))
def fleet(request, ckpt, tmp_path_factory):
    """(hand-off, two VEs and a PD answering as its vLLM): one fleet per hand-off for the two tests
    below (a fleet is ~2 CPU-s to start). Its VEs announce every entry; the test that needs
    epd-ve-0's broken sets that fault at run time (PUT /sim/faults) and heals it after."""
    handoff = request.param
    stack = _start(ckpt, tmp_path_factory.mktemp(f"handoff-{handoff}"), handoff, n_ve=2)
    yield handoff, stack
    stack.stop()


def _ve_faults(stack: Stack, **faults: object) -> None:
    """epd-ve-0's fault settings, all of them (what is not named is healthy)."""
    r = httpx.put(stack.ves[0].url + "/sim/faults", json=faults, timeout=5, trust_env=False)
    assert r.status_code == 200, r.text


def test_an_image_chat_crosses_in_the_fleets_handoff(oracle, fleet):
    handoff, stack = fleet
    _chat(stack, oracle, seed=300)
    _chat(stack, oracle, seed=310, images=3)
    pd_log = stack.pds[0].process.log()
    # vLLM logs this for every request whose kv_transfer_params no KV connector takes
    # (sim/pd.py): only vllm-neuron's hand-off rides there
    assert ("Got kv_transfer_params" in pd_log) == (handoff == "ec_locator")
    assert "EngineCore encountered a fatal error" not in pd_log


def test_a_ve_answer_without_a_fetchable_entry_is_charged_to_that_ve_and_reencoded(oracle, fleet):
    handoff, stack = fleet
    _ve_faults(stack, handoff_unannounced=True)
    try:
        # each image's VE is its HRW choice: up to 16 images until one was placed on the broken
        # VE (each has a 1-in-2 chance); every chat must be answered right regardless
        for seed in range(400, 416):
            _chat(stack, oracle, seed=seed)
            if stack.router.pools()["epd-ve-0"]["failures"] >= 1:
                break
        pools = stack.router.pools()
        assert pools["epd-ve-0"]["failures"] >= 1, pools
        assert pools["epd-ve-1"]["healthy"] and pools["epd-pd-0"]["healthy"], pools
        assert pools["epd-pd-0"]["failures"] == 0, pools
        what = "EC locator" if handoff == "ec_locator" else "ec_transfer_params entry with a producer address"
        assert f"no {what} for 1 item(s)" in stack.router.log()
        assert stack.pds[0].proc.poll() is None  # the PD never got an LM-only request
        assert "EngineCore encountered a fatal error" not in stack.pds[0].process.log()
    finally:
        _ve_faults(stack)


def test_a_0_32_pd_that_cannot_fetch_an_item_fails_that_request_and_the_router_encodes_it_elsewhere(
    ckpt, oracle, tmp_path
):
    """Upstream's PD fails only the request whose item it could not read from the address it had
    (vLLM 0.32.0: FINISHED_ERROR, "re-issuing the request re-runs the encode"); the router
    retries on another PD with the items encoded on the other VE. Nothing dies, nobody is
    charged (the same generation error comes for any failed generation)."""
    stack = _start(ckpt, tmp_path, "ec_transfer_params", n_ve=2, n_pd=2, broken_ve={"EPD_SIM_SIDE_CHANNEL": "refuse"})
    failing = "No local model input is available; failing the request."
    try:
        for seed in range(500, 516):  # until an image's HRW choice was the VE whose reads fail
            _chat(stack, oracle, seed=seed)
            if any(failing in pd.process.log() for pd in stack.pds):
                break
        assert any(failing in pd.process.log() for pd in stack.pds)
        assert "retrying on another PD" in stack.router.log()
        pools = stack.router.pools()
        assert all(pools[e]["failures"] == 0 and pools[e]["healthy"] for e in pools), pools
        for pd in stack.pds:
            assert pd.proc.poll() is None and "EngineCore encountered a fatal error" not in pd.process.log()
    finally:
        stack.stop()


def test_a_kit_connector_pd_that_cannot_read_an_item_is_the_ves_failure_and_the_same_pd_serves_the_retry(
    ckpt, oracle, tmp_path
):
    """router.yaml `ec_read_failure: generation_error` (the kit's NIXL connector on vLLM 0.24/0.29,
    the plan writes it for vllm-cpu's nixl transport): a PD's failed read ends that request alone as
    vLLM's generic generation error, the PD lives. The router takes it for the VE's failure: the VE
    is charged, the item encoded again and the PD, the only one, tried once more; it is never
    charged. Here the VE's side channel refuses every read until the test heals it, so the retry
    fails too and the client gets the 502; healed, the next chats are served with no retry."""
    envs = {"epd-ve-0": {"EPD_SIM_SIDE_CHANNEL": "refuse"}, "epd-pd-0": {"EPD_SIM_EC_READ_FAILURE": "generation_error"}}
    stack = Stack.start(ckpt, tmp_path, n_ve=1, n_pd=1, sim_env=envs, ec_read_failure="generation_error")
    try:
        urls = [png_data_url(256, 224, seed=600)]
        body = {"model": "tiny", "messages": [user_message("Describe.", image_part(urls[0]))], "max_tokens": MAX_TOKENS}
        r = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)
        assert r.status_code == 502, r.text
        assert "vLLM generation error" in r.json()["error"]["message"]
        pd_log = stack.pds[0].process.log()
        # two reads failed on the one PD (the first call and its retry), and it lives
        assert pd_log.count("EPD NIXL EC: request") == 2, pd_log[-2000:]
        assert stack.pds[0].proc.poll() is None and "EngineCore encountered a fatal error" not in pd_log
        router_log = stack.router.log()
        assert "retrying on another PD" in router_log and "re-encoding items" in router_log
        pools = stack.router.pools()
        assert pools["epd-ve-0"]["failures"] >= 1 and pools["epd-pd-0"]["failures"] == 0, pools
        # healed: served, and the PD still never charged
        httpx.put(
            stack.ves[0].url + "/sim/faults", json={"side_channel": "ok"}, timeout=5, trust_env=False
        ).raise_for_status()
        _chat(stack, oracle, seed=610)
        assert stack.router.pools()["epd-pd-0"]["failures"] == 0
    finally:
        stack.stop()
