"""Several router hosts behind HAProxy, several router processes per host (docs/router.md
"Scale-out" and "Several router hosts"). Layout: n1 and n2 each run 1 VE + 1 PD and a router
with 2 processes (epd-router@0/@1 on epd-router.socket); n3 runs HAProxy (group
epd_loadbalancer, Debian's package from .deb files: the test hosts have no mirror). HAProxy
terminates TLS with a certificate of a sandbox CA made at test time (tests/hosts/certs.py); the
clients verify it with that CA. Bounded load through HAProxy, every request counted. Tests run in
file order on one deployment."""

from __future__ import annotations

import csv
import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import LoadGenerator, Stack, wait_for
from tests.hosts.certs import SandboxCa, served_serial, trust
from tests.hosts.harness import (
    REPO,
    HostPool,
    TestHost,
    ansible_playbook,
    host_offset,
    hosts_env,
    machine_address,
    write_inventory,
)

# a first deploy of three hosts plus a kit upgrade: more than the default 300 s on a loaded VM
pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1200)]

BASE = REPO / "inventory/sandbox/three-host"
ROUTER_HOSTS = ("n1", "n2")
LB_URL = f"https://{machine_address(3)}:8080"
STATS_URL = f"http://{machine_address(3)}:8404/stats;csv"
LB_HOST = TestHost(f"n{3 + host_offset()}", machine_address(3))  # the machine playing n3 in this lane
# HAProxy's checks (the role's defaults): a dead router is out after inter × fall
CHECK_INTER_S, CHECK_FALL = 1.0, 2
DETECTION_WINDOW_S = CHECK_INTER_S * CHECK_FALL
RATE_PER_S = 8
STEP_LIMIT_S = 480  # a deploy under load beside two other lanes took over 300 s in one cold run


# the clients' trust in the sandbox CA, set by the `ca` fixture (module scope, like the deployment)
TLS: dict[str, object] = {}


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> SandboxCa:
    authority = SandboxCa(tmp_path_factory.mktemp("router-ha-ca"))
    TLS["verify"] = trust(authority)
    return authority


@pytest.fixture(scope="module")
def inventory(tmp_path_factory, ca) -> Path:
    # the .deb files of haproxy and what the test hosts lack, fetched outside the kithub namespace
    # (no Debian mirror in there) by `tests/hosts/hosts.sh prepare` (scripts/test.sh runs it)
    haproxy_debs = Path(hosts_env()["KIT_DIR"]) / "haproxy-debs"
    if not any(haproxy_debs.glob("haproxy_*.deb")):
        pytest.fail(
            f"no haproxy .deb in {haproxy_debs}: `tests/hosts/hosts.sh prepare` fetches them and "
            "scripts/test.sh runs it before pytest; this run skipped or lost that step",
            pytrace=False,
        )
    engine = {"epd_num_ve": 1, "epd_num_pd": 1, "epd_core_count": 16}  # VE tp4 + PD tp8
    hosts_yml = {
        "all": {
            "children": {
                "epd_engines": {
                    "hosts": {
                        name: {"ansible_host": f"10.213.0.1{i}", "epd_bind_address": f"10.213.0.1{i}", **engine}
                        for i, name in ((1, "n1"), (2, "n2"))
                    }
                },
                "epd_router": {"hosts": {name: {} for name in ROUTER_HOSTS}},
                "epd_loadbalancer": {
                    "hosts": {"n3": {"ansible_host": "10.213.0.13", "epd_bind_address": "10.213.0.13"}}
                },
                "epd_monitoring": {"hosts": {}},
            }
        }
    }
    # the front door's pair as an operator gives it (paths on the controller); a renewal rewrites them
    front_door = ca.issue("front-door", [machine_address(3)])
    group_vars = {
        "epd_router_workers": 2,
        "epd_haproxy_deb_dir": str(haproxy_debs),
        "epd_tls_certificate": str(front_door.certificate),
        "epd_tls_key": str(front_door.key),
    }
    return write_inventory(tmp_path_factory.mktemp("router-ha") / "inventory", BASE, hosts_yml, group_vars)


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, inventory: Path, record_timing) -> Iterator[Stack]:
    try:
        # deploy.yml's last play installs HAProxy on n3
        stack = deploy_stack(host_pool, inventory, record_timing, "router HA (2 router hosts x 2 processes + HAProxy)")
    except BaseException:
        for name in ROUTER_HOSTS:
            host = host_pool.host(int(name[1:]))
            print(f"--- {name}", host.run("systemctl --no-pager status 'epd-router*'", check=False).stdout[-3000:])
            print(host.run("journalctl --no-pager -q -n 80 -u 'epd-router*'", check=False).stdout[-6000:])
        raise
    return stack


def router_url(name: str) -> str:
    return f"http://{machine_address(int(name[1:]))}:18800"


def requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("epd_router_requests_total{")
    )


def server_states() -> dict[str, str]:
    """HAProxy's view of each router (UP, DOWN, ...), from its statistics page, read on n3 itself: the
    access rules let only monitoring hosts reach it from elsewhere (docs/security.md)."""
    page = LB_HOST.run(f"curl -sf --max-time 5 '{STATS_URL}'").stdout
    rows = csv.DictReader(io.StringIO(page.lstrip("# ")))
    return {
        row["svname"]: row["status"] for row in rows if row["pxname"] == "epd_routers" and row["svname"] in ROUTER_HOSTS
    }


def router_pids(stack: Stack) -> dict[str, str]:
    return {
        f"{name}/{unit}": stack.hosts[name].show(unit, "MainPID")["MainPID"]
        for name in ROUTER_HOSTS
        for unit in ("epd-router@0.service", "epd-router@1.service")
    }


def chat(model: str, n: int) -> dict:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"request {n}: say hello"}]}


def load(stack: Stack, seconds: float) -> LoadGenerator:
    return LoadGenerator(
        LB_URL,
        stack.model_id(),
        rate_per_s=RATE_PER_S,
        max_requests=int(RATE_PER_S * seconds),
        max_seconds=seconds,
        verify=TLS["verify"],  # type: ignore[arg-type]
    )


def test_two_router_hosts_with_two_processes_each_serve_through_haproxy(stack):
    for name in ROUTER_HOSTS:
        host = stack.hosts[name]
        assert host.is_active("epd-router.socket") == "active", name
        assert [u for u in host.units("epd-router@*") if host.is_active(u) == "active"] == [
            "epd-router@0.service",
            "epd-router@1.service",
        ], name
    wait_for(lambda: set(server_states().values()) == {"UP"}, timeout=30, what="both routers UP in HAProxy")
    before = {name: requests_total(router_url(name)) for name in ROUTER_HOSTS}
    model = stack.model_id()
    with httpx.Client(base_url=LB_URL, timeout=30, verify=TLS["verify"]) as client:  # type: ignore[arg-type]
        for n in range(20):
            assert client.post("/v1/chat/completions", json=chat(model, n)).status_code == 200
    served = {name: requests_total(router_url(name)) - before[name] for name in ROUTER_HOSTS}
    assert sum(served.values()) == 20 and all(served.values()), served


def test_the_front_door_speaks_tls_only(stack):
    """Plain HTTP on HAProxy's client port gets no HTTP answer; a client without the CA refuses
    the certificate; the openai SDK with the CA is answered, streaming and not, with an image."""
    pem = stack.hosts["n3"].run("stat -c '%U:%G %a' /etc/haproxy/epd-front-door.pem").stdout.split()
    assert pem == ["root:haproxy", "640"], pem  # the key's only copy on the host
    plain = LB_URL.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/ready", timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(LB_URL + "/ready", timeout=5)  # the system's trust store does not know the sandbox CA
    from openai import OpenAI

    from tests.e2e.stack import image_message

    client = OpenAI(
        base_url=LB_URL + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=TLS["verify"], timeout=60),  # type: ignore[arg-type]
    )
    model = client.models.list().data[0].id
    messages = image_message("what is in the picture?", (200, 40, 40))
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert answer.choices[0].message.content, answer
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert chunks and chunks[-1].choices[0].finish_reason, chunks[-1:]
    print(f"openai SDK over TLS through HAProxy: 1 answer, 1 stream of {len(chunks)} chunks, usage {answer.usage}")


def test_a_certificate_renewal_reloads_haproxy_without_a_failed_request(stack, ca, inventory, record_timing):
    """The operator writes a renewed pair over the inventory's files and runs the load-balancer
    play under load: HAProxy reloads (new handshakes get the new certificate), no request fails,
    and the play's output carries no key."""
    address = machine_address(3)
    before = served_serial(address, 8080, ca.path)
    with load(stack, STEP_LIMIT_S) as during:
        during.answered()
        renewed = ca.issue("front-door", [address])  # the same paths the inventory names
        start = time.monotonic()
        result = ansible_playbook(inventory, "playbooks/loadbalancer.yml", timeout=STEP_LIMIT_S)
        record_timing("router HA: certificate renewal (loadbalancer play, HAProxy reload)", time.monotonic() - start)
        during.answered()
        outcome = during.stop()
    assert result.returncode == 0, result.describe()
    assert before != renewed.serial and served_serial(address, 8080, ca.path) == renewed.serial
    assert outcome.sent >= RATE_PER_S * 5
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    key_line = renewed.key.read_text().splitlines()[1]
    assert key_line not in result.stdout and "PRIVATE KEY" not in result.stdout
    print(f"renewal under load through HAProxy: {outcome.ok} of {outcome.sent} answered")


def test_the_metrics_of_one_host_count_both_processes(stack):
    """Ten requests straight to n1 (the socket spreads them over its two processes): every
    scrape, whichever process answers it, counts all ten."""
    url = router_url("n1")
    before = requests_total(url)
    model = stack.model_id()
    for n in range(10):
        with httpx.Client(base_url=url, timeout=30) as client:  # a new connection each: either process
            assert client.post("/v1/chat/completions", json=chat(model, n)).status_code == 200
    assert {requests_total(url) - before for _ in range(6)} == {10.0}


def test_a_dead_router_host_fails_no_request_after_the_detection_window(stack, record_timing):
    n2 = stack.hosts["n2"]
    with load(stack, 3 + DETECTION_WINDOW_S + 2) as during:
        during.answered()
        killed_at = time.monotonic()
        n2.systemctl("kill", "--signal=SIGKILL", "epd-router@0.service", "epd-router@1.service")
        n2.systemctl("stop", "epd-router.service")  # and its listener (PartOf): the host is gone
        wait_for(lambda: server_states()["n2"].startswith("DOWN"), timeout=10, what="HAProxy marks n2 DOWN")
        record_timing("router HA: HAProxy marks a killed router DOWN", time.monotonic() - killed_at)
        outcome = during.stop()
    # what the kill cost inside the window: requests in flight on the killed processes
    record_timing("router HA: failed requests inside the detection window", len(outcome.failures), "requests")
    with load(stack, 10) as after:
        time.sleep(10)
        outcome = after.stop()
    assert outcome.sent >= RATE_PER_S * 5
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    n2.systemctl("start", "epd-router.service")
    wait_for(lambda: server_states()["n2"] == "UP", timeout=30, what="HAProxy puts n2 back")


def upgraded_kit(directory: Path) -> Path:
    """The kit's sources with one more line: a new wheel, so a deploy installs a new kit."""
    shutil.copytree(REPO / "router", directory / "router", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, directory / name)
    init = directory / "router/epd_kit/__init__.py"
    init.write_text(init.read_text() + f"\n# kit upgrade test {time.time()}\n")
    return directory


def test_a_kit_upgrade_rolls_every_router_process_without_a_failed_request(stack, inventory, tmp_path, record_timing):
    wait_for(lambda: set(server_states().values()) == {"UP"}, timeout=30, what="both routers UP in HAProxy")
    before = router_pids(stack)
    kit = upgraded_kit(tmp_path / "kit")
    with load(stack, STEP_LIMIT_S) as during:
        during.answered()
        start = time.monotonic()
        result = ansible_playbook(
            inventory,
            "playbooks/deploy.yml",
            "-e",
            f"epd_deps_repo_dir={kit}",
            "-e",
            f"epd_deps_wheelhouse_cache={REPO / '.cache/wheelhouse'}",
            timeout=STEP_LIMIT_S,
        )
        record_timing("router HA: deploy of a new kit (routers roll)", time.monotonic() - start)
        during.answered()
        outcome = during.stop()
    assert result.returncode == 0, result.describe()
    after = router_pids(stack)
    assert all(before[unit] != after[unit] for unit in before), (before, after)
    assert outcome.sent >= RATE_PER_S * 5
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    roll = [line for line in result.stdout.splitlines() if "Roll the router processes" in line]
    assert roll, result.describe()


def processes(stack: Stack, name: str) -> dict[str, str]:
    """The host's running router processes and their PIDs."""
    host = stack.hosts[name]
    running = [unit for unit in host.units("epd-router@*") if host.is_active(unit) == "active"]
    return {unit: host.show(unit, "MainPID")["MainPID"] for unit in running}


def deploy_router(inventory: Path, change: dict) -> tuple[object, float]:
    start = time.monotonic()
    result = ansible_playbook(
        inventory, "playbooks/deploy.yml", "--tags", "router", "-e", json.dumps(change), timeout=STEP_LIMIT_S
    )
    assert result.returncode == 0, result.describe()
    return result, time.monotonic() - start


def test_router_changes_roll_process_by_process_without_a_failed_request(stack, inventory, record_timing):
    """A process count, an environment, a process unit and a config section read only at start,
    changed in one deploy and changed back in another, under load straight to n1's router (no
    HAProxy retry to hide a reset) and through HAProxy: no request fails and the listener
    (epd-router.socket) is never restarted (issue 21 item 3)."""
    wait_for(lambda: set(server_states().values()) == {"UP"}, timeout=30, what="both routers UP in HAProxy")
    sockets = {name: stack.hosts[name].show("epd-router.socket", "InvocationID") for name in ROUTER_HOSTS}
    before = {name: processes(stack, name) for name in ROUTER_HOSTS}
    assert all(list(units) == ["epd-router@0.service", "epd-router@1.service"] for units in before.values()), before
    changed = {
        "epd_router_workers": 3,
        "epd_router_environment": {"EPD_ROLL_TEST": "1"},  # the env file
        "epd_router_limit_nofile": 60000,  # the process unit
        "epd_router_media": {"fetch_timeout_s": 7},  # a section read only at start
    }
    direct = LoadGenerator(
        router_url("n1"), stack.model_id(), rate_per_s=RATE_PER_S, max_requests=RATE_PER_S * 400, max_seconds=400
    )
    with direct, load(stack, 400) as through_lb:
        direct.answered()
        through_lb.answered()
        result, took = deploy_router(inventory, changed)
        record_timing("router HA: deploy of a router change (processes roll, 2 -> 3)", took)
        during = {name: processes(stack, name) for name in ROUTER_HOSTS}
        limits = {name: stack.hosts[name].show("epd-router@0.service", "LimitNOFILE") for name in ROUTER_HOSTS}
        env = {
            name: stack.hosts[name].run("grep -c EPD_ROLL_TEST /etc/epd/router.env", check=False).stdout.strip()
            for name in ROUTER_HOSTS
        }
        _, took = deploy_router(inventory, {})
        record_timing("router HA: deploy back (processes roll, 3 -> 2)", took)
        direct.answered()
        through_lb.answered()
        outcomes = {"n1 direct": direct.stop(), "through HAProxy": through_lb.stop()}
    for what, outcome in outcomes.items():
        record_timing(f"router HA: requests during the router changes, {what}", outcome.sent, "requests")
        assert outcome.sent >= RATE_PER_S * 10, (what, outcome.sent)
        assert outcome.ok == outcome.sent, (
            what,
            f"{len(outcome.failures)} of {outcome.sent} failed",
            outcome.failures[:10],
        )
    assert "Roll the router processes" in result.stdout and "LISTENER CHANGE" not in result.stdout, result.describe()
    after = {name: processes(stack, name) for name in ROUTER_HOSTS}
    for name in ROUTER_HOSTS:
        assert stack.hosts[name].show("epd-router.socket", "InvocationID") == sockets[name], f"{name}: socket restarted"
        assert list(during[name]) == [f"epd-router@{n}.service" for n in range(3)], (name, during)
        assert all(during[name][unit] != pid for unit, pid in before[name].items()), (name, before, during)
        assert limits[name] == {"LimitNOFILE": "60000"} and env[name] == "1", (name, limits, env)
        assert list(after[name]) == ["epd-router@0.service", "epd-router@1.service"], (name, after)
        assert all(after[name][unit] != during[name][unit] for unit in after[name]), (name, during, after)


def test_a_new_router_port_is_announced_and_check_mode_changes_nothing(stack, inventory):
    """The one change that needs a new socket: `--check` names it per host, restarts nothing."""
    sockets = {name: stack.hosts[name].show("epd-router.socket", "InvocationID") for name in ROUTER_HOSTS}
    result = ansible_playbook(
        inventory,
        "playbooks/deploy.yml",
        "--check",
        "--tags",
        "router",
        "-e",
        '{"epd_router_port": 18801}',
        timeout=300,
    )
    assert result.returncode == 0, result.describe()
    said = " ".join(result.stdout.split())  # the callback wraps long messages
    for name in ROUTER_HOSTS:
        address = machine_address(int(name[1:]))  # the inventory's address, on this lane's machine
        assert f"LISTENER CHANGE on {name}: epd-router.socket moves from {address}:18800 to {address}:18801" in said, (
            result.describe()
        )
        assert stack.hosts[name].show("epd-router.socket", "InvocationID") == sockets[name], name
