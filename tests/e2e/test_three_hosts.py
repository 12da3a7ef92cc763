"""Three hosts (inventory/sandbox/three-host): VEs on n1, PDs on n2, the router on n3,
engines bound to their private addresses. Tests run in file order on one deployment; the last
grows it to the four-host fleet, on which test_day2 continues (conftest: shared stacks). That a
second deploy changes nothing on any host is test_day2's last step, on the grown fleet after
every day-2 change."""

from __future__ import annotations

import json
import shlex
import time

import pytest
import yaml

from tests.e2e.access import nft_set, open_ports
from tests.e2e.conftest import FOUR_HOSTS
from tests.e2e.secrets_scan import ENGINE_PROBE, python_on, scan_stack, stack_secrets
from tests.e2e.stack import LoadGenerator, Stack, four_host_fleet, image_message, is_healthy, under_load, wait_for
from tests.hosts.harness import TestHost, ansible_playbook, machine_address, relocated
from tests.hosts.sandbox import SandboxInventory

pytestmark = pytest.mark.systemd

# what the planner must derive from inventory/sandbox/three-host (several engine hosts: ids carry
# the host label, instances and ports are numbered per host)
# (addresses as the inventory has them, on this lane's machines: harness.relocated)
EXPECTED_VE = relocated({"epd-n1-ve-0": "http://10.213.0.11:18300", "epd-n1-ve-1": "http://10.213.0.11:18301"})
EXPECTED_PD = relocated({"epd-n2-pd-0": "http://10.213.0.12:18100", "epd-n2-pd-1": "http://10.213.0.12:18101"})
ENGINE_UNITS = {
    "n1": ["epd-engine@ve-0.service", "epd-engine@ve-1.service"],
    "n2": ["epd-engine@pd-0.service", "epd-engine@pd-1.service"],
}


def main_pids(stack) -> dict[str, str]:
    pids = {}
    for host, units in ENGINE_UNITS.items():
        for unit in units:
            pids[f"{host}/{unit}"] = stack.hosts[host].show(unit, "MainPID")["MainPID"]
    return pids


def test_router_endpoints_match_the_inventory(three_host_stack):
    stack = three_host_stack
    config = yaml.safe_load(stack.hosts["n3"].run("cat /etc/epd/router.yaml").stdout)
    [model] = config["models"]  # one model: its pools (router.yaml's one list, docs/router.md)
    endpoints = model["endpoints"]
    assert {e["id"]: e["url"] for e in endpoints["ve"]} == EXPECTED_VE
    assert {e["id"]: e["url"] for e in endpoints["pd"]} == EXPECTED_PD
    pools = {e["id"]: e for e in stack.pools()}
    assert {i: e["url"] for i, e in pools.items()} == EXPECTED_VE | EXPECTED_PD
    assert all(is_healthy(e) for e in pools.values()), pools


def test_engines_bind_their_private_address_and_live_where_planned(three_host_stack):
    hosts = three_host_stack.hosts
    listening = {name: hosts[name].run("ss -Hltn").stdout for name in hosts}
    for port in (18300, 18301, 14600):
        assert f"{machine_address(1)}:{port}" in listening["n1"], listening["n1"]
    for port in (18100, 18101):
        assert f"{machine_address(2)}:{port}" in listening["n2"], listening["n2"]
    assert hosts["n3"].units("epd-engine@*") == []
    assert hosts["n1"].units("epd-router*") == [] and hosts["n2"].units("epd-router*") == []
    assert hosts["n3"].is_active("epd-router.service") == "active"
    for name in hosts:  # every host reached its targets: `systemctl status epd.target` tells the truth
        assert hosts[name].is_active("epd.target") == "active", name
    for name in ("n1", "n2"):
        assert hosts[name].is_active("epd-engines.target") == "active", name


def test_the_engines_take_the_fleet_key_and_no_secret_leaks(three_host_stack, record_timing):
    """Issue 37 items 2 and 5 (docs/security.md): one engine key per fleet, in root-only files
    and the engines' environment file; a PD refuses /inference without it (vLLM's check, the sim's
    copy) and takes it from the router host; no secret is anywhere else: not in a journal, a file
    readable beyond root and the kit's group, a process's argv, the deploy's output or an answer."""
    start = time.monotonic()
    stack = three_host_stack
    hosts = stack.hosts
    secrets = stack_secrets(stack)
    assert {"engine key 1", "admin token 1"} <= set(secrets), sorted(secrets)
    assert "engine key 2" not in secrets  # the previous key of a rotation is gone once it ends
    assert (
        hosts["n3"].run("stat -c %a:%U:%G /etc/epd/engine-key /etc/epd/admin-token").stdout.split()
        == ["640:root:epd"] * 2
    )
    for name in ("n1", "n2"):
        assert hosts[name].run("stat -c %a:%U:%G /etc/epd/engine-key.env").stdout.strip() == "600:root:root"
    probe = json.loads(python_on(hosts["n3"], ENGINE_PROBE, "", EXPECTED_PD["epd-n2-pd-0"]))
    assert probe["without the key"] == [401, '{"error":"Unauthorized"}'], probe
    assert probe["with the key"][0] != 401, probe
    bodies = {f"POST a PD {name}": f"{status} {body}" for name, (status, body) in probe.items()}
    with stack.http(10) as client:
        for method, path, content in (
            ("POST", "/v1/chat/completions", b"{not json"),
            ("POST", "/v1/chat/completions", b'{"model": "x", "messages": []}'),
            ("GET", "/no-such-path", b""),
            ("GET", "/pools", b""),
            ("GET", "/metrics", b""),
        ):
            answer = client.request(method, path, content=content or None)
            bodies[f"{method} {path} {content[:20]!r}"] = f"{answer.status_code} {answer.text}"
    leaks, seen = scan_stack(stack, secrets, bodies)
    # the scan read the hosts' files: it found the keys where they belong
    assert {("n3", "/etc/epd/engine-key"), ("n3", "/etc/epd/admin-token")} <= seen, seen
    assert {("n1", "/etc/epd/engine-key.env"), ("n2", "/etc/epd/engine-key.env")} <= seen, seen
    record_timing("3 hosts: secret grep (journals, files, argv, deploy output, answers)", time.monotonic() - start)
    assert leaks == [], "\n".join(leaks)


def test_pd_reads_embeddings_from_a_ve_on_another_host(three_host_stack):
    stack = three_host_stack
    before = {e["id"]: e.get("served", 0) for e in stack.pools()}
    red = stack.chat(image_message("What is in the picture?", (200, 30, 30)), max_tokens=16)
    again = stack.chat(image_message("What is in the picture?", (200, 30, 30)), max_tokens=16)
    blue = stack.chat(image_message("What is in the picture?", (30, 30, 200)), max_tokens=16)
    assert red.choices[0].message.content == again.choices[0].message.content
    assert red.choices[0].message.content != blue.choices[0].message.content
    after = {e["id"]: e.get("served", 0) for e in stack.pools()}
    # VE work happened on n1 and PD work on n2: the embedding crossed hosts
    assert sum(after[i] - before[i] for i in EXPECTED_VE) >= 1
    assert sum(after[i] - before[i] for i in EXPECTED_PD) >= 3


def connect_from(host: TestHost, address: str, port: int) -> str:
    """'open', 'refused' or 'timeout': a TCP connect from inside `host` (3 s at most)."""
    code = (
        "import socket, sys\ns = socket.socket()\ns.settimeout(3)\n"
        "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
        "except ConnectionRefusedError:\n    print('refused')\nexcept TimeoutError:\n    print('timeout')"
    )
    return host.run(f"python3 -c {shlex.quote(code)} {address} {port}").stdout.strip()


def test_only_the_planned_peers_reach_the_engine_and_side_channel_ports(three_host_stack):
    """docs/security.md "Who can reach what": the VE host n1 is neither router nor PD, so a PD's port
    refuses it; the router n3 is no PD, so a VE's side channel refuses it; the router reaches the
    engines and the PD host the side channels (the image requests above read VE blocks across hosts)."""
    hosts = three_host_stack.hosts
    n1, n2 = machine_address(1), machine_address(2)
    assert connect_from(hosts["n1"], n2, 18100) == "refused"
    assert connect_from(hosts["n3"], n1, 14600) == "refused"
    assert connect_from(hosts["n2"], n1, 14600) == "open"
    health = hosts["n3"].run(f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://{n2}:18100/health")
    assert health.stdout == "200"
    assert nft_set(hosts["n1"], "side_channel_v4") == [n2]
    assert nft_set(hosts["n2"], "engine_http_v4") == [machine_address(3)]


def test_a_port_scan_from_outside_the_fleet_finds_only_ssh_and_the_router(three_host_stack):
    """From the controller (a client network, not a peer): every port each host listens on and the
    kit's port ranges; open are SSH and, on the router host, the router port."""
    found = {name: open_ports(host) for name, host in three_host_stack.hosts.items()}
    assert found == {"n1": [22], "n2": [22], "n3": [22, 18800]}, found


def test_rolling_restart_under_load_fails_no_request(three_host_stack, record_timing):
    stack = three_host_stack
    before = main_pids(stack)
    with LoadGenerator(
        stack.router_url, stack.model_id(), rate_per_s=12, max_requests=12 * 240, max_seconds=240
    ) as load:
        load.answered()
        start = time.monotonic()
        result = ansible_playbook(stack.inventory.directory, "playbooks/rolling_restart.yml", timeout=400)
        elapsed = time.monotonic() - start
        load.answered()
        outcome = load.stop()
    record_timing("3 hosts: rolling restart of 4 engines", elapsed)
    assert result.returncode == 0, result.describe()
    assert outcome.sent >= 12 * 5 and outcome.ok == outcome.sent, outcome.failures[:10]
    for host, units in ENGINE_UNITS.items():  # each engine's startup progress, under its own host
        for unit in units:
            instance = unit.removeprefix("epd-engine@").removesuffix(".service")
            assert f"[{host}] {instance}: ready" in result.stdout, result.describe()
    after = main_pids(stack)
    assert all(after[k] != before[k] for k in before), (before, after)  # every engine restarted
    for e in stack.pools():
        assert is_healthy(e) and e["state"] == "active", e


def test_adding_an_engine_host_reloads_the_router_and_restarts_no_engine(
    three_host_stack, host_pool, shared_stacks, tmp_path
):
    stack = three_host_stack
    # with the kit as the lane's first deploy installed it (conftest.deploy_stack): what this step
    # checks is the router's reload and the engines left alone, not the install (test_one_host's)
    (n4,) = host_pool.up(4, kit=True)
    kept = False
    try:
        fleet = four_host_fleet(tmp_path / "four-host")
        engines_before = main_pids(stack)
        router_before = stack.hosts["n3"].show("epd-router@0.service", "MainPID", "NRestarts")
        # under load (no request may fail): the peers let n4 in before its engine starts
        result, _ = under_load(stack, "playbooks/deploy.yml", inventory=fleet.directory)
        assert n4.is_active("epd-engine@pd-0.service") == "active"
        plays = result.stdout
        assert plays.index("PLAY [Open the access rules") < plays.index("PLAY [Deploy and start the engines")
        assert nft_set(stack.hosts["n1"], "side_channel_v4") == sorted([machine_address(2), n4.address])
        assert nft_set(n4, "engine_http_v4") == [machine_address(3)]
        assert main_pids(stack) == engines_before, "an existing engine was restarted"
        assert stack.hosts["n3"].show("epd-router@0.service", "MainPID", "NRestarts") == router_before, (
            "the router was restarted instead of reloaded"
        )
        wait_for(
            lambda: any(
                e["id"] == "epd-n4-pd-0" and e["url"] == f"http://{n4.address}:18100" and is_healthy(e)
                for e in stack.pools()
            ),
            timeout=30,
            what="epd-n4-pd-0 in the router's pools",
        )
        for i in range(4):
            assert stack.chat(image_message(f"with a fourth host #{i}", (90, 200, 90)), max_tokens=4).choices
        # n4's PD reads VE blocks from n1 through n1's rules (bounded: the router spreads over 3 PDs)
        for i in range(12):
            if stack.engine("epd-n4-pd-0").get("served", 0):
                break
            stack.chat(image_message(f"for n4 #{i}", (i * 20, 90, 90)), max_tokens=4)
        assert stack.engine("epd-n4-pd-0").get("served", 0) >= 1
        # test_day2 continues on this four-host fleet (conftest: shared stacks)
        shared_stacks.keep(FOUR_HOSTS, Stack(SandboxInventory.load(fleet.directory), {**stack.hosts, "n4": n4}))
        kept = True
    finally:
        if not kept:
            host_pool.down(n4)
