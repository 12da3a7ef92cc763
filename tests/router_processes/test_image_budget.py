"""On a real router (+ sims): one attacker sends scan-bomb JPEGs (progressive,
last scan repeated: seconds of decode each) with all three tricks that dodged the per-client
image bound (leaving while its decode runs, its key as `Bearer K` and `bearer K`, a second
connection), and a victim's small images are still answered quickly. The bench's figure and
goal (< 1 s): bench/hostile.py `attacks`, docs/router.md."""

from __future__ import annotations

import base64
import contextlib
import io
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from bench import hostile

from .harness import HOST, Stack

# the scan limit is raised so the bombs reach the decoder: what is tested is the budget and
# the slots (with the default limit they are a 400 before any decode: test_decode_budget.py)
LIMITS = {"image_workers": 2, "max_jpeg_scans": 5000, "image_decode_timeout_s": 4.0}


def image_request(data: bytes, mime: str, headers: dict[str, str]) -> bytes:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    body = hostile.json.dumps(hostile.user([hostile.image(url)]))
    return hostile.http(body, headers=headers)


def attacker(port: int, stop: threading.Event, headers: list[dict[str, str]]) -> None:
    """Bombs on two connections at a time, alternating the key's spelling; every other one
    is left (closed) 0.3 s after it was sent, while its decode runs. Bounded: 40 sends."""
    for n in range(40):
        if stop.is_set():
            return
        raw = image_request(hostile.scan_bomb(2560, 600, n), "image/jpeg", headers[n % len(headers)])
        socks = [socket.create_connection((HOST, port), timeout=30) for _ in range(2)]
        try:
            for sock in socks:
                sock.sendall(raw)
            time.sleep(0.3)
            socks[0].close()  # the first trick: leave while the decode runs
            socks[1].settimeout(30)
            with contextlib.suppress(OSError):
                socks[1].recv(65536)
        finally:
            for sock in socks:
                sock.close()


def victim(url: str, headers: dict[str, str], source: str, n: int) -> list[float]:
    seconds = []
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=url, timeout=30, transport=transport, headers=headers) as client:
        for seed in range(n):
            png = io.BytesIO()
            Image.new("RGB", (64, 64), (seed, 2 * seed, 3)).save(png, format="PNG")
            url_ = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            t = time.monotonic()
            resp = client.post("/v1/chat/completions", json=hostile.user([hostile.image(url_)]))
            seconds.append(time.monotonic() - t)
            assert resp.status_code == 200, resp.text
            time.sleep(0.2)
    return seconds


def under_attack(stack: Stack, attacker_headers: list[dict[str, str]], victim_headers: dict[str, str], source: str):
    stop = threading.Event()
    thread = threading.Thread(target=attacker, args=(stack.router.port, stop, attacker_headers), daemon=True)
    thread.start()
    try:
        time.sleep(1.5)  # the attacker's decodes in full swing
        return victim(stack.router.url, victim_headers, source, 8)
    finally:
        stop.set()
        thread.join(60)


@pytest.fixture(scope="module")
def keyed(ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("image-budget-keys")
    keys = work / "keys"
    keys.write_text("attacker-key\nvictim-key\n")
    keys.chmod(0o600)
    s = Stack.start(ckpt, work, n_ve=1, n_pd=1, limits=LIMITS, auth={"api_keys_file": str(keys)})
    yield s
    s.stop()


def test_an_attackers_scan_bombs_do_not_delay_a_victims_image_with_keys(keyed):
    attacker_headers = [{"Authorization": "Bearer attacker-key"}, {"Authorization": "bearer  attacker-key"}]
    seconds = under_attack(keyed, attacker_headers, {"Authorization": "Bearer victim-key"}, "127.0.0.1")
    # the goal is < 1 s (bench/hostile.py); before, the victim waited 10-24 s: a shared CI
    # machine gets slack, no more
    assert max(seconds) < 2.0, seconds
    log = keyed.router.log()
    assert "Traceback" not in log and "internal error" not in log


@pytest.fixture(scope="module")
def open_router(ckpt, tmp_path_factory):
    s = Stack.start(ckpt, tmp_path_factory.mktemp("image-budget-open"), n_ve=1, n_pd=1, limits=LIMITS)
    yield s
    s.stop()


def test_without_keys_a_second_connection_does_not_dodge_the_bound(open_router):
    # the attacker on 127.0.0.1, the victim connects from 127.0.0.2 (traffic still goes to 127.0.0.1)
    seconds = under_attack(open_router, [{}], {}, "127.0.0.2")
    assert max(seconds) < 2.0, seconds
    log = open_router.router.log()
    assert "Traceback" not in log and "internal error" not in log
