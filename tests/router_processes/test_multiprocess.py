"""Several router processes on one listening socket (docs/router.md "Scale-out"): what systemd's
epd-router.socket gives epd-router@0..N-1, reproduced without systemd (bench.router_processes).

Placement must not depend on which process takes a request, the shared /metrics must count the
whole group, and a process that drains must hand its share to the others without a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.mmap_dict import MmapedDict

from bench.procs import VENV_BIN
from bench.router_processes import SOCKET_ACTIVATE, router_group
from bench.stack import engine_proc
from epd_kit.testing.process import ManagedProcess
from tests.budget import scaled
from tests.router_processes.harness import wait_until_async

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}

_PLACE_ITEMS = """
import json, sys
from epd_kit.router.placement import Item, place_items
items = [Item(f"{n:064x}", work=1 + n % 5) for n in range(300)]
loads = {f"epd-n{h}-ve-{i}": float((h * 7 + i) % 4) for h in range(3) for i in range(4)}
print(json.dumps(place_items(items, loads, bound=1.15, slack_items=6.0), sort_keys=True))
"""


def test_placement_is_identical_in_every_process():
    """HRW and the bounded-load rule are pure functions of the hash, the VE ids and their loads:
    no per-process salt (Python's string hashing is randomized per process and must not leak in)."""
    answers = {
        subprocess.run(
            [sys.executable, "-c", _PLACE_ITEMS],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=scaled(60),
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(answers) == 1
    assert len(set(json.loads(answers.pop()).values())) > 1  # the items did spread over several VEs


@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory):
    """A VE and a PD for the module's router groups: what the tests count is the routers' own
    (their metrics files, statuses), so one pair serves them all (~1.2 CPU-s a pair to start)."""
    workdir = tmp_path_factory.mktemp("engines")
    procs = [engine_proc("ve", 0, ckpt, workdir).start(), engine_proc("pd", 0, ckpt, workdir).start()]
    try:
        for proc in procs:
            proc.wait_healthy()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def config(ckpt, engines, tmp_path) -> Path:
    ve, pd = engines
    path = tmp_path / "router.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(ckpt),
                "listen": {"host": "127.0.0.1", "port": 0},  # the socket comes from the launcher
                "endpoints": {"ve": [{"id": ve.name, "url": ve.url}], "pd": [{"id": pd.name, "url": pd.url}]},
            }
        )
    )
    return path


async def _chats(url: str, count: int, concurrency: int) -> list[int]:
    """`count` chat requests, each on a new connection (so the kernel spreads them over the
    processes' accepts), `concurrency` at a time; the statuses (-1: no answer)."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with gate, httpx.AsyncClient(base_url=url, timeout=scaled(30), trust_env=False) as client:
            try:
                return (await client.post("/v1/chat/completions", json=CHAT)).status_code
            except httpx.HTTPError:
                return -1

    return list(await asyncio.gather(*(one() for _ in range(count))))


def _sum_in_file(path: Path, sample: str, **labels: str) -> float:
    """The sum of one sample's values in one process's metrics file, over the series that carry
    `labels` (a key there is JSON: [metric, sample, labels, help])."""
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
        _, name, series, _ = json.loads(key)
        if name == sample and labels.items() <= series.items():
            total += value
    return total


def _fleet_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("epd_router_requests_total{")
    )


def test_two_processes_share_the_listener_and_count_as_one(config, tmp_path):
    with router_group(config, 2, tmp_path / "group") as group:
        statuses = asyncio.run(_chats(group.url, 60, 12))
        assert statuses == [200] * 60
        files = {w: group.metrics_dir / f"counter_{w}.db" for w in (0, 1)}
        per_worker = {w: _sum_in_file(path, "epd_router_requests_total") for w, path in files.items()}
        assert all(per_worker.values()), f"one process served everything: {per_worker}"
        assert sum(per_worker.values()) == 60
        # any process answers /metrics (the scrape lands on either), always with the group's total
        assert {_fleet_requests(group.url) for _ in range(6)} == {60.0}


def test_a_draining_process_hands_its_share_to_the_other(config, tmp_path):
    """SIGTERM to one process under load: it stops accepting at once, finishes what it has, and
    the other takes every new connection; no request fails and no count is lost."""
    with router_group(config, 2, tmp_path / "group") as group:

        async def load_with_a_drain() -> list[int]:
            load = asyncio.create_task(_chats(group.url, 120, 8))
            await asyncio.sleep(0.5)
            group.processes[0].send_signal(signal.SIGTERM)
            return await load

        statuses = asyncio.run(load_with_a_drain())
        assert statuses == [200] * 120
        assert group.processes[0].wait(30) == 0
        assert group.processes[1].poll() is None
        # the stopped process's counters stay in the sum; its live gauges (in flight) are gone
        assert _fleet_requests(group.url) == 120
        assert not list(group.metrics_dir.glob("gauge_live*_0.db"))
        assert asyncio.run(_chats(group.url, 4, 4)) == [200] * 4


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 response with a Content-Length; b"" when the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body


def _until_draining(log: Path) -> None:
    """Until the process's drain has shut its connections down (its log says so)."""
    deadline = time.monotonic() + scaled(30)
    while "stopped accepting from the shared listener" not in log.read_text():
        assert time.monotonic() < deadline, "the process did not begin to drain in time"
        time.sleep(0.05)


def test_a_request_arriving_on_a_kept_alive_connection_when_the_drain_begins_is_answered(config, tmp_path):
    """A client reuses its kept-alive connection; the first half of its request head is in when
    the process is told to stop. The drain must not close that connection as idle (the request
    would be lost, the client sees the server disconnect without an answer): it answers it with
    `Connection: close`, and the process exits."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n"
    with router_group(config, 1, tmp_path / "group") as group:
        process = group.processes[0]
        with socket.create_connection(("127.0.0.1", group.port), timeout=30) as sock:
            sock.sendall(request + b"\r\n")
            head, _ = _read_response(sock)
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()  # kept alive
            sock.sendall(request[:20])
            time.sleep(0.5)  # the process reads it: a request head has begun
            process.send_signal(signal.SIGTERM)
            _until_draining(tmp_path / "group/router-0.log")
            sock.sendall(request[20:] + b"\r\n")
            head, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"connection: close" in head.lower()
        assert process.wait(30) == 0


def test_a_client_reusing_its_idle_connection_as_the_drain_begins_is_answered(config, tmp_path):
    """Issue 55's race (1 of 854 requests reset while a deploy rolled the processes): a client
    takes its idle kept-alive connection from its pool just as the process starts to drain, and
    sends on it. The drain closed every idle connection at once, so the request met a closed
    socket (EOF or a reset, no answer). Now an idle connection stays open until no client would
    reuse it (listener.py `drain_linger_s`): the request is answered with `Connection: close`
    and the connection closed after it. A second client that only stays idle is closed at the
    linger's end, and the process exits within its shutdown grace (no "grace period over")."""
    cfg = yaml.safe_load(config.read_text())
    cfg["timeouts"] = {"shutdown_grace_s": 4}  # a linger of 2 s: half the grace
    config.write_text(yaml.safe_dump(cfg))
    request = b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"
    with router_group(config, 1, tmp_path / "group") as group:
        process = group.processes[0]
        with (
            socket.create_connection(("127.0.0.1", group.port), timeout=scaled(30)) as reusing,
            socket.create_connection(("127.0.0.1", group.port), timeout=scaled(30)) as idle,
        ):
            for sock in (reusing, idle):
                sock.sendall(request)
                head, _ = _read_response(sock)
                assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()  # kept alive
            process.send_signal(signal.SIGTERM)
            _until_draining(tmp_path / "group/router-0.log")
            reusing.sendall(request)
            head, body = _read_response(reusing)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"connection: close" in head.lower()
            assert json.loads(body)["data"], body  # the answer itself, whole
            assert reusing.recv(1) == b""  # closed after its answer
            assert idle.recv(1) == b""  # closed by the drain at the linger's end, not kept to the idle timeout
        assert process.wait(scaled(30)) == 0
    log = (tmp_path / "group/router-0.log").read_text()
    assert "grace period over" not in log, log[-2000:]


def test_a_sigterm_while_the_process_starts_stops_it_once_it_serves(config, tmp_path):
    """systemd may stop a router process that is still starting (a deploy rolls it again, an
    operator stops the group). The signal arrives before uvicorn has its listeners: it must be
    kept and acted on when they exist (drain, exit 0), not lost while the process goes on."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    argv = [str(VENV_BIN / "epd-router"), "serve", "--config", str(config), "--worker", "0"]
    router = ManagedProcess(
        [sys.executable, "-c", SOCKET_ACTIVATE, str(listener.fileno()), *argv],
        tmp_path / "router.log",
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        name="router process 0",
        pass_fds=[listener.fileno()],
    )
    try:
        # logged when the app and its socket are set up, before uvicorn's startup
        router.wait_until(
            lambda: "serving on sockets from systemd" in router.log(), 60, "the socket set up", interval=0.01
        )
        router.signal(signal.SIGTERM)
        assert router.wait_exit(60) == 0, router.log_tail()
        assert "stopped accepting from the shared listener" in router.log()
        assert "Traceback" not in router.log(), router.log_tail()
    finally:
        router.stop()
        listener.close()


@pytest.fixture
def slow_pd_config(ckpt, tmp_path) -> Iterator[tuple[Path, dict]]:
    """A VE and a PD that answers every request 10 s late on the quiet machine, later on a slow one
    (tests/budget.py): requests stay in flight while the test reads /pools. Yields the config path
    and the config itself."""
    late_s = scaled(10)
    slow = ["--sim-profile", "zero", "--sim-extra-latency-ms", str(round(late_s * 1000))]
    procs = [engine_proc("ve", 0, ckpt, tmp_path).start(), engine_proc("pd", 0, ckpt, tmp_path, sim_flags=slow).start()]
    try:
        for proc in procs:
            proc.wait_healthy()
        ve, pd = procs
        config = {
            "model": str(ckpt),
            "listen": {"host": "127.0.0.1", "port": 0},
            "endpoints": {"ve": [{"id": ve.name, "url": ve.url}], "pd": [{"id": pd.name, "url": pd.url}]},
            # the first-token deadline (15 s by default) past the PD's lateness: late, not hung
            "timeouts": {"first_token_base_s": late_s + 15},
        }
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        yield path, config
    finally:
        for proc in procs:
            proc.stop()


async def _pd_views(url: str, count: int) -> list[dict]:
    """`count` reads of /pools, each on a new connection (either process may answer); the PD's entry."""
    views = []
    for _ in range(count):
        async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as client:
            engines = (await client.get("/pools")).json()["engines"]
        views.append(next(e for e in engines if e["role"] == "pd"))
    return views


def _inflight_per_worker(metrics_dir: Path, engine: str) -> dict[int, float]:
    return {
        worker: _sum_in_file(path, "epd_router_engine_inflight", engine=engine)
        for worker in (0, 1)
        if (path := metrics_dir / f"gauge_livesum_{worker}.db").exists()
    }


def test_pools_answers_for_the_whole_group_so_a_drain_waits_for_every_process(slow_pd_config, tmp_path):
    """A rollout drains an engine by polling /pools until it says draining with 0 in flight. With
    several processes the poll reaches one of them: it used to answer with its own count and its
    own state, so a process with nothing in flight, or the first to reload, let the play stop an
    engine another process still had requests on. Every process now answers for the group."""
    path, config = slow_pd_config
    pd = config["endpoints"]["pd"][0]["id"]
    with router_group(path, 2, tmp_path / "group") as group:

        async def scenario() -> tuple[list[int], dict[str, list[dict]], dict[int, float]]:
            async def spaced_load() -> list[int]:  # apart, so the kernel hands them to both processes
                tasks = []
                for _ in range(10):
                    tasks.append(asyncio.create_task(_chats(group.url, 1, 1)))
                    await asyncio.sleep(0.1)
                return [status for statuses in await asyncio.gather(*tasks) for status in statuses]

            async def first_view(predicate) -> bool:
                return predicate((await _pd_views(group.url, 1))[0])

            async def until(what: str, holds) -> None:
                # each step waits on what it needs, not on a fixed sleep a loaded machine outruns
                # (the PD's lateness would pass first)
                await wait_until_async(holds, 5, what)

            load = asyncio.create_task(spaced_load())
            seen: dict[str, list[dict]] = {}
            await until("the 10 requests in flight together", lambda: first_view(lambda v: v["inflight"] == 10))

            async def published() -> bool:  # every process has published its count
                return sum(_inflight_per_worker(group.metrics_dir, pd).values()) == 10

            await until("both processes' counts published", published)
            split = _inflight_per_worker(group.metrics_dir, pd)
            seen["loaded"] = await _pd_views(group.url, 6)
            config["endpoints"]["pd"][0]["state"] = "draining"
            path.write_text(yaml.safe_dump(config))
            group.processes[0].send_signal(signal.SIGHUP)  # process 1 has not reloaded yet
            await until("process 0 reloaded", lambda: first_view(lambda v: v["state"] != "active"))
            seen["half_reloaded"] = await _pd_views(group.url, 6)
            group.processes[1].send_signal(signal.SIGHUP)
            await until("process 1 reloaded", lambda: first_view(lambda v: v["state"] == "draining"))
            seen["reloaded"] = await _pd_views(group.url, 6)
            statuses = await load
            await until("the load's end seen", lambda: first_view(lambda v: v["inflight"] == 0))
            seen["drained"] = await _pd_views(group.url, 6)
            return statuses, seen, split

        statuses, seen, split = asyncio.run(scenario())
    assert statuses == [200] * 10
    assert len(split) == 2 and all(split.values()), f"one process took every request: {split}"
    assert {(v["state"], v["inflight"]) for v in seen["loaded"]} == {("active", 10)}, seen["loaded"]
    # one process still sends the PD work: no answer may call it draining
    assert {v["state"] for v in seen["half_reloaded"]} == {"reloading"}, seen["half_reloaded"]
    assert {(v["state"], v["inflight"]) for v in seen["reloaded"]} == {("draining", 10)}, seen["reloaded"]
    assert {(v["state"], v["inflight"]) for v in seen["drained"]} == {("draining", 0)}, seen["drained"]


def test_two_processes_share_a_tenants_token_bucket(ckpt, engines, tmp_path):
    """A tenant's quota is the host's, not each process's (docs/router.md "Tenants"): answers
    charged in one process refuse the tenant in the other. 60 tokens a minute and answers of
    ~50 tokens: the group admits 2 requests in all (each process alone would admit 2)."""
    ve, pd = engines
    tenants = tmp_path / "tenants"
    tenants.write_text("tenant t tokens_per_min=60\nkey t sk-tenant-t\n")
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
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 40, "ignore_eos": True}
    auth = {"Authorization": "Bearer sk-tenant-t"}
    with router_group(path, 2, tmp_path / "group") as group:
        statuses = []
        for _ in range(16):  # a new connection each: the kernel hands them to either process
            with httpx.Client(base_url=group.url, timeout=30, trust_env=False) as client:
                statuses.append(client.post("/v1/chat/completions", json=body, headers=auth).status_code)
        files = {w: group.metrics_dir / f"counter_{w}.db" for w in (0, 1)}
        seen = {w: _sum_in_file(p, "epd_router_tenant_requests_total", tenant="t") for w, p in files.items()}
        refusals = {w: _sum_in_file(p, "epd_router_tenant_requests_total", result="refused") for w, p in files.items()}
    assert all(seen.values()), f"one process took every request, nothing shared was tested: {seen}"
    assert statuses.count(200) == 2 and statuses.count(429) == 14, statuses
    assert sum(refusals.values()) == 14, refusals
