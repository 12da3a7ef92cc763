"""A real vLLM PD asked to generate for an image whose embedding no VE stored (the contract's
missing-block failure, docs/contract.md §3.5), through the kit's router.

VE epd-ve-1 writes its embeddings to an EC store of its own, which no PD reads (as a VE whose
blocks no PD can read: a wrong `shared_storage_path`, a side channel down on Neuron). Its
locators reach a PD, which finds no embedding and dies as vLLM dies: its engine core fails,
the API server answers that request (and every other it has) with vLLM's EngineDeadError
message, never the cause, and exits 0. The router must take that answer for a failed read:
charge and quarantine epd-ve-1, re-encode the items on epd-ve-0, and serve the chat from the
other PD, so the client gets its 200. The dead PD exits 0 (hence the unit's Restart=always);
here, without systemd, the test restarts it as systemd would and the router readmits it.

A load of image chats, one at a time, each a new image (never in the shared store), bounded
in count; epd-ve-1 is drained (SIGHUP reload) until a PD has read epd-ve-0's blocks, since the
router moves a request only onto blocks of a VE a PD has read from.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import yaml

from epd_kit.router.upstream import ENGINE_DEAD_MESSAGE
from epd_kit.testing.images import image_part, png_data_url, user_message

from .stack import RealStack

BAD_VE, GOOD_VE = "epd-ve-1", "epd-ve-0"
MAX_CHATS = 16  # per round; HRW puts each new image on epd-ve-1 with probability 1/2
EXIT_WITHIN_S = 30  # the dead PD's API server stops itself (vLLM's watchdog: every 5 s at most)


@pytest.fixture(scope="module")
def stack(ckpt, plugin_site, tmp_path_factory):
    work = tmp_path_factory.mktemp("missing-block")
    elsewhere = work / "ve-1-store"
    elsewhere.mkdir()
    one = RealStack.start(work, ckpt, plugin_site, n_ve=2, n_pd=2, ec_stores={BAD_VE: elsewhere})
    yield one
    one.stop()


def set_state(stack: RealStack, engine_id: str, state: str) -> None:
    """The router's config with `engine_id` in `state`, applied by SIGHUP (docs/router.md "Reload")."""
    path = stack.workdir / "router.yaml"
    config = yaml.safe_load(path.read_text())
    for endpoint in config["endpoints"]["ve"] + config["endpoints"]["pd"]:
        if endpoint["id"] == engine_id:
            endpoint["state"] = state
    path.write_text(yaml.safe_dump(config))
    assert stack.router is not None
    stack.router.signal(signal.SIGHUP)
    wait(lambda: stack.pools()[engine_id]["state"] == state, 30, f"{engine_id} {state}")


def wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


def wait_pool(stack: RealStack, engine_id: str, key: str, value: object, timeout: float) -> None:
    wait(lambda: stack.pools()[engine_id][key] == value, timeout, f"{engine_id} {key} = {value}")


def chat(stack: RealStack, seed: int, stream: bool) -> tuple[int, str]:
    """One image chat with a new image; (status, body) as the client got them."""
    body = {
        "model": str(stack.ckpt),
        "messages": [user_message(image_part(png_data_url(64, 48, seed=seed)), "What is this?")],
        "max_tokens": 4,
        "stream": stream,
    }
    answer = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=240, trust_env=False)
    return answer.status_code, answer.text


def metric(stack: RealStack, name: str, labels: str) -> float:
    text = httpx.get(stack.url + "/metrics", timeout=10, trust_env=False).text
    found = re.search(re.escape(name) + r"\{" + re.escape(labels) + r"\} ([0-9.e+-]+)", text)
    return float(found.group(1)) if found else 0.0


def ok(status: int, text: str, stream: bool) -> bool:
    if status != 200:
        return False
    return text.rstrip().endswith("data: [DONE]") and '"error"' not in text if stream else '"choices"' in text


def dead_pds(stack: RealStack) -> list:
    return [pd for pd in stack.pds if pd.process is not None and pd.process.returncode is not None]


def test_a_pd_without_the_embedding_dies_and_the_router_serves_the_chat_elsewhere(stack):
    set_state(stack, BAD_VE, "draining")
    status, text = chat(stack, 1000, False)  # a PD reads epd-ve-0's blocks
    assert ok(status, text, False), (status, text[-500:])
    set_state(stack, BAD_VE, "active")
    seeds = iter(range(2000, 3000))
    rounds = []
    for stream in (False, True):
        died_before = {pd.engine_id for pd in dead_pds(stack)}
        retries = metric(stack, "epd_router_retries_total", 'stage="generate"')
        ve_failures = metric(stack, "epd_router_engine_failures_total", f'engine="{BAD_VE}",role="ve"')
        outcomes = []
        for _ in range(MAX_CHATS):
            status, text = chat(stack, next(seeds), stream)
            outcomes.append((status, text[-300:]))
            assert ok(status, text, stream), outcomes  # the client never sees the death
            died = [pd for pd in dead_pds(stack) if pd.engine_id not in died_before]
            if died or stack.pools()[BAD_VE]["quarantined_s"] > 0:
                break
        else:
            pytest.fail(f"no chat of {MAX_CHATS} reached {BAD_VE}: {outcomes}")
        served_at = time.monotonic()
        dead_before = len(died_before)
        wait(lambda: len(dead_pds(stack)) > dead_before, EXIT_WITHIN_S, "the PD without the embedding to exit")  # noqa: B023
        (pd,) = [pd for pd in dead_pds(stack) if pd.engine_id not in died_before]
        exited_s = time.monotonic() - served_at
        # vLLM's API server stops itself once its engine core died, and exits 0: a unit with
        # Restart=on-failure would leave it down (templates/epd-engine@.service.j2)
        assert pd.process.returncode == 0, pd.log()[-3000:]
        engine_log = pd.log()
        assert "EngineCore encountered a fatal error" in engine_log, engine_log[-3000:]
        # what the PD told the router: vLLM's fixed message, not the cause
        assert ENGINE_DEAD_MESSAGE in stack.router.log()
        assert metric(stack, "epd_router_retries_total", 'stage="generate"') == retries + 1
        assert metric(stack, "epd_router_engine_failures_total", f'engine="{BAD_VE}",role="ve"') > ve_failures
        assert metric(stack, "epd_router_engine_quarantines_total", f'engine="{BAD_VE}"') == len(rounds) + 1
        pools = stack.pools()
        assert pools[BAD_VE]["quarantined_s"] > 0 and pools[BAD_VE]["healthy"] is False
        assert pools[GOOD_VE]["healthy"] is True and pools[GOOD_VE]["failures"] == 0
        wait_pool(stack, pd.engine_id, "healthy", False, 30)  # ejected
        rounds.append(
            {
                "stream": stream,
                "chats": len(outcomes),
                "pd": pd.engine_id,
                "exit_after_answer_s": round(exited_s, 1),
                "root cause lines": [line[-200:] for line in engine_log.splitlines() if "Error" in line][-4:],
            }
        )
        # systemd's part (Restart=always): start it again; the router readmits it
        started = time.monotonic()
        pd.start()
        pd.wait_healthy()
        wait_pool(stack, pd.engine_id, "healthy", True, 60)  # readmitted
        rounds[-1]["restart_s"] = round(time.monotonic() - started, 1)
        if not stream:  # the next round needs epd-ve-1 back in service: its quarantine ends
            wait_pool(stack, BAD_VE, "quarantined_s", 0, 130)
            wait_pool(stack, BAD_VE, "healthy", True, 30)
    print("missing block rounds:", rounds)
    for pd in stack.pds:  # the restarted PDs serve
        assert pd.process is not None and pd.process.returncode is None
    status, text = chat(stack, 1000, True)
    assert ok(status, text, True), text[-500:]
