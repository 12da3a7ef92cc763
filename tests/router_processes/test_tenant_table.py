"""The tenants' shared table under faults, with two real router processes on one socket (what
systemd's epd-router@0..1 are) and sim engines on 127.0.0.1 (issue 58 item 2): a lock another
process holds for 5 s holds up neither /health nor any tenant; a table truncated or overwritten
under the running processes kills none of them and costs no request a 500; and a request
refused before its body (401, a tenant's 429) does not make the router read the body. Every
loop is bounded in count and time."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from bench.router_processes import router_group
from bench.stack import engine_proc
from epd_kit.router.tenant_table import FOLLOW_EVERY_S, TABLE_FILE

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
CALM, SLOW = "sk-calm-tenant-0001", "sk-slow-tenant-0001"


@pytest.fixture
def group(ckpt, tmp_path):
    procs = [engine_proc("ve", 0, ckpt, tmp_path).start(), engine_proc("pd", 0, ckpt, tmp_path).start()]
    try:
        for proc in procs:
            proc.wait_healthy()
        ve, pd = procs
        tenants = tmp_path / "tenants"
        tenants.write_text(
            "tenant calm requests_per_s=1000 concurrent_requests=50 tokens_per_min=10000000\n"
            "tenant slow requests_per_s=0.001\n"
            f"key calm {CALM}\nkey slow {SLOW}\n"
        )
        tenants.chmod(0o640)
        path = tmp_path / "router.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "model": str(ckpt),
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "auth": {"tenants_file": str(tenants)},
                    "endpoints": {"ve": [{"id": ve.name, "url": ve.url}], "pd": [{"id": pd.name, "url": pd.url}]},
                }
            )
        )
        with router_group(path, 2, tmp_path / "group") as g:
            yield g
    finally:
        for proc in procs:
            proc.stop()


def chat(url: str, key: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:  # a new connection: either process
        return client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})


def timed(call) -> tuple[float, object]:
    t = time.monotonic()
    result = call()
    return time.monotonic() - t, result


def test_a_lock_held_for_5s_holds_up_neither_health_nor_the_tenants(group):
    table = group.metrics_dir / TABLE_FILE
    assert chat(group.url, CALM).status_code == 200  # the table exists
    # clients made beforehand (making one costs more than a request here), a connection each:
    # the kernel hands them to either process
    clients = [httpx.Client(base_url=group.url, timeout=10, trust_env=False) for _ in range(7)]
    auth = {"Authorization": f"Bearer {CALM}"}
    holder = os.open(table, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a stray process holds it (it used to freeze every worker)
    released = time.monotonic() + 5
    try:
        with ThreadPoolExecutor(7) as pool:  # all sent at once, while the lock is held
            health = [pool.submit(timed, lambda c=c: c.get("/health")) for c in clients[:3]]
            chats = [
                pool.submit(timed, lambda c=c: c.post("/v1/chat/completions", json=CHAT, headers=auth))
                for c in clients[3:]
            ]
            done = [f.result() for f in health + chats]
        finished = time.monotonic()
        time.sleep(max(0.0, released - time.monotonic()))  # the whole hold
    finally:
        os.close(holder)
        for client in clients:
            client.close()
    assert finished < released, "the requests took the whole hold: they did not test it"
    health_s = [seconds for seconds, _ in done[: len(health)]]
    chat_s = [seconds for seconds, _ in done[len(health) :]]
    assert all(r.status_code == 200 for _, r in done), [r.text for _, r in done]
    assert max(health_s) < 1, health_s  # 4.8 s before
    assert max(chat_s) < 2.5, chat_s  # 5 s before
    metrics = chat_metrics(group.url)
    assert re.search(r'epd_router_tenant_table_faults_total\{fault="busy"\} [1-9]', metrics), metrics[-3000:]


def chat_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {CALM}"}, timeout=5, trust_env=False).text


def test_a_table_truncated_or_overwritten_under_running_processes_kills_none(group):
    table: Path = group.metrics_dir / TABLE_FILE
    statuses = [chat(group.url, CALM).status_code for _ in range(4)]
    size = table.stat().st_size
    # a header cut short: the first slot's page is still in the file (a mapping read it without a
    # fault), so the repair is tested here, the SIGBUS below
    os.truncate(table, 100)
    statuses += [chat(group.url, CALM).status_code for _ in range(8)]
    os.truncate(table, 0)  # every process used to die of SIGBUS on its next tenant request
    statuses += [chat(group.url, CALM).status_code for _ in range(4)]
    # garbage in every slot and the header, at the table's full size: whether a process has made
    # the truncated file whole again by now is a race, and a 100-byte write would be "truncated"
    table.write_bytes(os.urandom(size))
    # a process reads the header at most once per FOLLOW_EVERY_S: on a fast machine the next
    # requests all came within the last check's second and no process saw the garbage
    time.sleep(FOLLOW_EVERY_S * 1.2)
    statuses += [chat(group.url, CALM).status_code for _ in range(8)]
    statuses += [chat(group.url, SLOW).status_code for _ in range(4)]
    assert all(member.popen.poll() is None for member in group.members), "a router process died"
    assert set(statuses[:24]) == {200}, statuses
    assert set(statuses[24:]) <= {200, 429} and statuses[24:].count(200) <= 2, statuses  # one per process at most
    faults = chat_metrics(group.url)
    assert re.search(r'epd_router_tenant_table_faults_total\{fault="truncated"\} [1-9]', faults)
    assert re.search(r'epd_router_tenant_table_faults_total\{fault="foreign"\} [1-9]', faults)


@pytest.mark.parametrize("key", ["sk-not-a-key", SLOW], ids=["401", "429"])
def test_a_request_refused_before_its_body_does_not_have_it_read(group, key):
    if key == SLOW:
        chat(group.url, SLOW)  # its one request per 1000 s
    declared = 64 * 1024 * 1024
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    sent = 0
    with socket.create_connection(("127.0.0.1", group.port), timeout=10) as conn:
        conn.sendall(head)
        answer = conn.recv(65536)
        assert answer.split(b" ", 2)[1] in (b"401", b"429"), answer[:200]
        chunk = b"x" * 65536
        conn.settimeout(2)
        deadline = time.monotonic() + 30
        try:
            while sent < declared and time.monotonic() < deadline:
                sent += conn.send(chunk)
        except (ConnectionError, TimeoutError):
            pass  # closed by the router (a reset), or nothing more taken
    # the router used to read all 64 MiB to keep the connection; now listener.MAX_DISCARD_BYTES
    # (256 KiB), plus what the kernel's socket buffers of both ends hold
    assert sent < declared / 4, sent
