"""An engine-key rotation under load fails no request (docs/security.md "Engine keys"): real
epd-sim engines that check VLLM_API_KEY as vLLM 0.24.0 does and a real epd-router, driven as
deploy.yml does it with -e epd_rotate_engine_key=true: the router's key file gets the new key
first and the old one second (reload), each engine is drained, restarted with the new key and
put back (the rollout), then the file keeps the new key alone (reload). Bounded load (text and
image requests, about 20 a second, at most 3000 requests or 150 s) runs through all of it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.router_processes.harness import Stack, wait_until

OLD, NEW = "k-old-4e1f0b9d2a77", "k-new-93c2d8aa1b05"
ENGINES = ("epd-ve-0", "epd-ve-1", "epd-pd-0", "epd-pd-1")


class Load(threading.Thread):
    """Sequential chat requests, every third with an image, until stopped (bounded)."""

    def __init__(self, url: str, max_requests: int = 3000, max_s: float = 150) -> None:
        super().__init__(daemon=True)
        self.url, self.max_requests, self.max_s = url, max_requests, max_s
        self.stopped = threading.Event()
        self.sent, self.failures = 0, []

    def run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as client:
            while not self.stopped.is_set() and self.sent < self.max_requests and time.monotonic() < deadline:
                parts = [image_part(png_data_url(64, 64, seed=self.sent % 5))] if self.sent % 3 == 0 else []
                body = {"model": "tiny", "messages": [user_message("Hello there.", *parts)], "max_tokens": 4}
                answer = client.post("/v1/chat/completions", json=body)
                self.sent += 1
                if answer.status_code != 200:
                    self.failures.append(f"{answer.status_code} {answer.text[:200]}")
                time.sleep(0.05)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)


def write_keys(path: Path, *keys: str) -> None:
    path.write_text("".join(k + "\n" for k in keys))
    path.chmod(0o640)


@pytest.fixture
def keyed_stack(ckpt, tmp_path):
    key_file = tmp_path / "engine-key"
    write_keys(key_file, OLD)
    sim_env = {engine: {"VLLM_API_KEY": OLD} for engine in ENGINES}
    stack = Stack.start(ckpt, tmp_path, 2, 2, sim_env=sim_env, engine_auth={"key_file": str(key_file)})
    try:
        yield stack, key_file
    finally:
        stack.stop()


def set_state(stack: Stack, engine_id: str, state: str) -> None:
    for pool in stack.config["endpoints"].values():
        for entry in pool:
            if entry["id"] == engine_id:
                entry["state"] = state
    stack.router.write_config(stack.config)
    stack.router.reload()


def test_a_rolling_key_rotation_under_load_fails_no_request(keyed_stack):
    stack, key_file = keyed_stack
    router = stack.router
    load = Load(router.url)
    load.start()
    try:
        wait_until(lambda: load.sent >= 10, 30, "the load to flow")
        # 1. the routers hold the new key first and the old one second, before any engine changes
        write_keys(key_file, NEW, OLD)
        router.reload()
        # 2. the rollout: each engine drained, restarted with the new key, put back
        for engine in stack.ves + stack.pds:
            set_state(stack, engine.engine_id, "draining")
            wait_until(lambda e=engine: router.pools()[e.engine_id]["inflight"] == 0, 30, f"{engine.engine_id} drained")
            engine.stop()
            engine.sim_env["VLLM_API_KEY"] = NEW
            engine.start()
            engine.wait_healthy()
            set_state(stack, engine.engine_id, "active")
            wait_until(lambda e=engine: router.pools()[e.engine_id]["healthy"], 30, f"{engine.engine_id} back")
            sent = load.sent
            wait_until(lambda s=sent: load.sent >= s + 6, 30, "requests after the engine came back")
        # 3. the new key alone
        write_keys(key_file, NEW)
        router.reload()
        sent = load.sent
        wait_until(lambda: load.sent >= sent + 12, 30, "requests on the new key alone")
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert load.sent >= 60, load.sent
    log = router.log()
    # the old-key engines refused the new key once each and got the old one on the same request
    assert "trying the other key of engine_auth.key_file" in log
    assert NEW not in log and OLD not in log
    # every engine refuses the old key now
    for engine in stack.ves + stack.pds:
        refused = httpx.post(
            engine.url + "/inference/v1/generate", json={}, headers={"Authorization": f"Bearer {OLD}"}, timeout=5
        )
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
