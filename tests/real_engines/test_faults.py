"""Faults with real engines under bounded load: SIGKILL of a VE, then of a PD, of two each.

A load thread sends image chats one after another (bounded in count and time) through the
router while an engine dies; a request that starts after the router's detection window
(health.interval_s x failure_threshold + timeout_s, stack.HEALTH) must not fail.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message

from .stack import HEALTH, RealStack

DETECTION_S = HEALTH["interval_s"] * HEALTH["failure_threshold"] + HEALTH["timeout_s"]
AFTER_KILL_S = 3 * DETECTION_S + 5  # how long the load runs on after a kill
MAX_REQUESTS = 200
MAX_LOAD_S = 240


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    detail: str


@dataclass(eq=False)  # a Thread must stay hashable
class Load(threading.Thread):
    url: str
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        deadline = time.monotonic() + MAX_LOAD_S
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            for n in range(MAX_REQUESTS):
                if self.stopped.is_set() or time.monotonic() > deadline:
                    return
                # 12 distinct images, so both VEs own some (HRW) and repeats hit the store
                parts = [image_part(png_data_url(64, 48, seed=n % 12)), "What is this?"]
                if n % 4 == 3:
                    parts.append(image_part(png_data_url(48, 64, seed=100 + n % 5)))
                body = {"model": self.model, "messages": [user_message(*parts)], "max_tokens": 4}
                if n % 2:
                    body |= {"stream": True}
                started = time.monotonic()
                try:
                    answer = client.post("/v1/chat/completions", json=body)
                    # a stream that fails after its 200 ends in an error frame, not [DONE]
                    ok = answer.status_code == 200 and ("data: [DONE]" in answer.text or not n % 2)
                    detail = f"{answer.status_code} {answer.text[-300:]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, repr(exc)
                self.outcomes.append(Outcome(started, time.monotonic(), ok, detail))

    def between(self, start: float, end: float) -> list[Outcome]:
        """The requests that started at `start` or later and ended before `end`."""
        return [o for o in self.outcomes if o.started >= start and o.ended < end]


@pytest.fixture(scope="module")
def stack(ckpt, plugin_site, tmp_path_factory):
    one = RealStack.start(tmp_path_factory.mktemp("faults"), ckpt, plugin_site, n_ve=2, n_pd=2)
    yield one
    one.stop()


def kill_under_load(stack: RealStack, victim, load: Load) -> float:
    """SIGKILL `victim` once the load has had successes; return the kill time."""
    deadline = time.monotonic() + 60
    while sum(o.ok for o in load.outcomes) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    killed_at = time.monotonic()
    victim.kill()
    time.sleep(AFTER_KILL_S)
    return killed_at


def test_sigkill_of_a_ve_then_of_a_pd_fails_no_request_after_detection(stack):
    load = Load(stack.url, str(stack.ckpt))
    load.start()
    try:
        ve_killed = kill_under_load(stack, stack.ves[1], load)
        assert stack.pools()["epd-ve-1"]["healthy"] is False
        pd_killed = kill_under_load(stack, stack.pds[1], load)
        assert stack.pools()["epd-pd-1"]["healthy"] is False
    finally:
        load.stopped.set()
        load.join(180)
    # a stream the PD had started when it died fails (the client has its first bytes): the
    # VE's window ends where the PD's kill begins
    windows = {"epd-ve-1": (ve_killed + DETECTION_S, pd_killed), "epd-pd-1": (pd_killed + DETECTION_S, float("inf"))}
    for engine, (start, end) in windows.items():
        window = load.between(start, end)
        failed = [o for o in window if not o.ok]
        assert window and not failed, f"after {engine}'s detection window: {failed}"
    assert sum(o.ok for o in load.outcomes) >= 8
