"""A deployed sandbox stack as the end-to-end tests (and the sandbox benches) see it: the
inventory, its hosts, the router (real HTTP, real openai client), a bounded load generator, and
the four-host fleet that test_three_hosts grows and test_day2 rewrites step by step."""

from __future__ import annotations

import base64
import io
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.budget import describe, scaled
from tests.hosts.harness import REPO, PlaybookResult, TestHost, ansible_playbook, host_address, write_inventory
from tests.hosts.sandbox import SandboxInventory


def wait_for(
    predicate: Callable[[], object], *, timeout: float, interval: float = 0.3, what: str = "condition"
) -> object:
    """Poll until predicate() is truthy; bounded in time: `timeout` is the quiet machine's
    budget, scaled to this one (tests/budget.py). Returns its value."""
    deadline = time.monotonic() + scaled(timeout)
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {describe(timeout)} waiting for {what}"
        + (f" (last error: {last_error!r})" if last_error else "")
    )


def image_data_url(color: tuple[int, int, int], edge: int = 64) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (edge, edge), color)
    ImageDraw.Draw(image).rectangle([edge // 4, edge // 4, edge // 2, edge // 2], fill=(255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(text: str, color: tuple[int, int, int]) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(color)}},
                {"type": "text", "text": text},
            ],
        }
    ]


def engines_of(pools: object) -> list[dict]:
    """Flatten the router's /pools answer into engine entries (dicts with an 'id')."""
    found: list[dict] = []

    def walk(node: object, role: str | None) -> None:
        if isinstance(node, dict):
            if "id" in node and "url" in node:
                found.append({"role": role, **node})
                return
            for key, value in node.items():
                walk(value, key if key in ("ve", "pd") else role)
        elif isinstance(node, list):
            for item in node:
                walk(item, role)

    walk(pools, None)
    return found


def is_healthy(entry: dict) -> bool:
    value = entry.get("healthy", entry.get("health"))
    return value is True or value in ("healthy", "ok", "up")


@dataclass
class Stack:
    inventory: SandboxInventory
    hosts: dict[str, TestHost]
    timings: dict[str, float] = field(default_factory=dict)
    # what the first deploy printed (stdout and stderr): the secret grep reads it (secrets_scan.py)
    deploy_output: str = ""

    @property
    def router_url(self) -> str:
        return self.inventory.router_url

    @property
    def router_host(self) -> TestHost:
        return self.hosts[self.inventory.router_hosts[0]]

    def http(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, timeout=timeout)

    def pools(self) -> list[dict]:
        with self.http(5) as client:
            reply = client.get("/pools")
            reply.raise_for_status()
            return engines_of(reply.json())

    def engine(self, engine_id: str) -> dict:
        matches = [e for e in self.pools() if e["id"] == engine_id]
        assert matches, f"{engine_id} not in the router's /pools"
        return matches[0]

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            with self.http(3) as client:
                return client.get("/ready").status_code == 200

        wait_for(ready, timeout=timeout, what=f"router {self.router_url}/ready = 200")

    def wait_engine_health(self, engine_id: str, healthy: bool, timeout: float = 60) -> None:
        wait_for(
            lambda: is_healthy(self.engine(engine_id)) == healthy,
            timeout=timeout,
            what=f"{engine_id} healthy={healthy} in /pools",
        )

    def openai(self, timeout: float = 60):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.router_url}/v1", api_key="sandbox", timeout=timeout, max_retries=0)

    def model_id(self) -> str:
        return self.openai().models.list().data[0].id

    def chat(self, messages: list[dict], max_tokens: int = 8, **kwargs) -> object:
        client = self.openai()
        return client.chat.completions.create(model=self.model_id(), messages=messages, max_tokens=max_tokens, **kwargs)

    def chat_stream(self, messages: list[dict], max_tokens: int = 8) -> tuple[str, object]:
        """A streamed chat with usage: the text of its deltas and its last chunk (the usage one)."""
        chunks = list(self.chat(messages, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1]

    def engine_host(self, instance_host: str) -> TestHost:
        return self.hosts[instance_host]


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)


# how far the load generator's schedule may run behind before it drops the missed arrivals
MAX_LAG_S = 1.0


def next_arrival(due: float, gap: float, now: float) -> float:
    """When the load generator sends its next request: `gap` after the last one was due, on a
    schedule rather than a gap after each send (starting a thread and the workers' request building,
    which hold the GIL, took 6-19 % of the time between requests, and the load ran that much under
    its rate: a local stack at 4-5.6 requests/s, issue 55); a generator more than MAX_LAG_S behind
    drops the arrivals it missed instead of sending them in a burst."""
    return max(due + gap, now - MAX_LAG_S)


class LoadGenerator:
    """Sends chat requests (image + text) at a fixed rate from a background thread,
    bounded by count and time, and records every failure with its reason. Both bounds scale with
    the machine (tests/budget.py) as the playbook timeouts they are paired with do."""

    def __init__(
        self,
        router_url: str,
        model: str,
        *,
        rate_per_s: float = 12,
        max_requests: int = 3000,
        max_seconds: float = 300,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """`verify`: an https front door's trust (tests/hosts/certs.trust of the sandbox CA)."""
        self.router_url = router_url
        self.verify = verify
        self.model = model
        self.interval = 1.0 / rate_per_s
        self.max_requests = round(max_requests * scaled(1))
        self.max_seconds = scaled(max_seconds)
        self.result = LoadResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="load-generator", daemon=True)

    def __enter__(self) -> LoadGenerator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        self._thread.join(timeout=60)
        for worker in self._workers:
            worker.join(timeout=60)
        return self.result

    def answered(self, count: int = 2, timeout: float = 30) -> None:
        """Wait until `count` more requests have come back (answered or failed: the test's own
        assertions judge them), instead of a fixed sleep: the load flows before a step starts and
        still after it ends. Bounded in time; a load that stopped sending fails here."""
        with self._lock:
            target = self.result.ok + len(self.result.failures) + count
        wait_for(
            lambda: self.result.ok + len(self.result.failures) >= target,
            timeout=timeout,
            interval=0.05,
            what=f"{count} more load requests to come back ({self.result.sent} sent)",
        )

    def body(self, n: int) -> dict:
        """Request n's chat body: an image of one of 7 colours and a text."""
        return {
            "model": self.model,
            "max_tokens": 4,
            "messages": image_message(f"request {n}: what is in the picture?", (n % 7 * 30, 90, 200)),
        }

    def _one(self, client: httpx.Client, n: int) -> None:
        try:
            reply = client.post("/v1/chat/completions", json=self.body(n))
            ok = reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
            reason = f"HTTP {reply.status_code}: {reply.text[:200]}"
        except Exception as exc:
            ok, reason = False, repr(exc)
        with self._lock:
            if ok:
                self.result.ok += 1
            else:
                self.result.failures.append(f"#{n} at {time.strftime('%H:%M:%S')}: {reason}")

    def _run(self) -> None:
        start = time.monotonic()
        limits = httpx.Limits(max_connections=64)
        with httpx.Client(base_url=self.router_url, timeout=60, limits=limits, verify=self.verify) as client:
            n, due = 0, start
            while not self._stop.is_set() and n < self.max_requests and time.monotonic() - start < self.max_seconds:
                worker = threading.Thread(target=self._one, args=(client, n), daemon=True)
                worker.start()
                self._workers.append(worker)
                n += 1
                self.result.sent = n
                due = next_arrival(due, self.interval, time.monotonic())
                self._stop.wait(max(0.0, due - time.monotonic()))
            for worker in self._workers:
                worker.join(timeout=60)


@dataclass
class Fleet:
    """An inventory derived from a sandbox inventory (`base`) and rewritten per step."""

    directory: Path
    base: Path
    hosts_yml: dict
    group_vars: dict = field(default_factory=dict)

    def engine_host(self, name: str) -> dict:
        return self.hosts_yml["all"]["children"]["epd_engines"]["hosts"][name]

    def write(self) -> Path:
        return write_inventory(self.directory, self.base, self.hosts_yml, self.group_vars)


THREE_HOST = REPO / "inventory/sandbox/three-host"
# test_three_hosts grows the three-host fleet by n4 (one PD) and test_day2 continues on it
FOUR_HOST_ENGINE_HOSTS = ("n1", "n2", "n4")


def four_host_fleet(directory: Path) -> Fleet:
    """inventory/sandbox/three-host (n1: 2 VE, n2: 2 PD, n3: the router) plus n4 with 1 PD."""
    fleet = Fleet(directory, THREE_HOST, yaml.safe_load((THREE_HOST / "hosts.yml").read_text()))
    n4 = host_address(4)
    fleet.hosts_yml["all"]["children"]["epd_engines"]["hosts"]["n4"] = {
        "ansible_host": n4,
        "epd_bind_address": n4,
        "epd_num_ve": 0,
        "epd_num_pd": 1,
        "epd_core_count": 8,
    }
    fleet.write()
    return fleet


def engine_pids(stack: Stack, hosts: tuple[str, ...] = FOUR_HOST_ENGINE_HOSTS) -> dict[str, str]:
    """host/instance -> MainPID of every active engine."""
    pids = {}
    for name in hosts:
        host = stack.hosts[name]
        for unit in host.units("epd-engine@*"):
            state = host.show(unit, "ActiveState", "MainPID")
            if state["ActiveState"] == "active":
                pids[f"{name}/{unit.removeprefix('epd-engine@').removesuffix('.service')}"] = state["MainPID"]
    return pids


def restarted(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {engine for engine in before.keys() & after.keys() if before[engine] != after[engine]}


# journal lines that say why an engine stopped: its own errors and systemd's account of the stop
_STOP_REASONS = "ECLoad|EC |EngineDead|rror|ailed|timed out|exited|Stopping|Stopped|Started|Deactivated|SIG"


def why_restarted(stack: Stack, engines: set[str], lines: int = 40) -> str:
    """For each `host/instance` engine, the last journal lines about errors, stops and starts: a
    restart nobody planned explains itself in the failure (a dead engine core, a play's stop)."""
    out = []
    for engine in sorted(engines):
        host, instance = engine.split("/", 1)
        unit = f"epd-engine@{instance}.service"
        journal = stack.hosts[host].run(
            f"journalctl --no-pager -q -o short-precise -n 2000 -u {unit}"
            f" | grep -E '{_STOP_REASONS}' | tail -n {lines}",
            check=False,
        )
        out.append(f"--- {engine}\n{journal.stdout}")
    return "\n".join(out)


def under_load(
    stack: Stack,
    playbook: str,
    *args: str,
    inventory: Path | None = None,
    rate_per_s: float = 8,
    limit_s: float = 600,
) -> tuple[PlaybookResult, float]:
    """Run a playbook while bounded load goes through the router (at most `limit_s`, which
    every step ends well within); no request may fail. The playbook's own wall-clock comes back."""
    with LoadGenerator(
        stack.router_url,
        stack.model_id(),
        rate_per_s=rate_per_s,
        max_requests=int(rate_per_s * limit_s),
        max_seconds=limit_s,
    ) as load:
        load.answered()  # the load is flowing before the playbook starts
        start = time.monotonic()
        result = ansible_playbook(inventory or stack.inventory.directory, playbook, *args, timeout=limit_s)
        elapsed = time.monotonic() - start
        load.answered()  # ... and still after it ends
        outcome = load.stop()
    assert result.returncode == 0, result.describe()
    assert outcome.sent >= rate_per_s * 5, f"the load ran only {outcome.sent} requests"
    assert outcome.ok == outcome.sent, (
        f"{len(outcome.failures)} of {outcome.sent} failed",
        outcome.failures[:10],
        why_the_router_refused(stack),
    )
    return result, elapsed


def why_the_router_refused(stack: Stack, lines: int = 40) -> str:
    """The router's own account of failed requests: its warnings and errors (an engine ejected,
    quarantined or draining, a failed call), from every router host's journal."""
    out = []
    for name in stack.inventory.router_hosts:
        journal = stack.hosts[name].run(
            "journalctl --no-pager -q -o short-precise -n 5000 -u 'epd-router*'"
            f" | grep -iE 'warning|error|quarantin|eject|unhealthy' | tail -n {lines}",
            check=False,
        )
        out.append(f"--- router {name}\n{journal.stdout}")
    return "\n".join(out)
