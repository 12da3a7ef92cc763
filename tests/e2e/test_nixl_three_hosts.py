"""The three-host sandbox on real engines, deployed by the kit (issue 54 item 4):
inventory/sandbox/vllm-cpu-three-host (a vllm-cpu VE on n1, a PD on n2, the router on n3) with the
kit's NIXL EC connector carrying each image's encoder output from n1 to n2 over UCX's TCP transport.
Through the router host with the openai client: an image chat, a streamed one, two images in one
request, a repeated image; each item READ over NIXL from the VE, as the PD's connector logs it in
n2's journal (the line test_nixl_kit.READ parses), and n2's interfaces received at least those bytes.
The access rules from the hosts: the VE's side channel and UCX range open from n2 only (n3 and the
controller are refused). Then the faults: a SIGKILL of the VE mid-load and of the PD under bounded
load; once systemd restarted the engine and the router readmitted it no request fails, and the
router charges the VE for the failures its death caused (epd_router_engine_failures).

Once per vLLM (`epd_vllm_cpu_vllm`, a fresh stack each): 0.24.0 and 0.29.0 with the kit's connector
(`kv_transfer_params.ec_locator`, its READ lines name the VE), 0.32.0 with upstream's NIXL connector
run on CPU by the kit's subclass (`ec_transfer_params`, its READ lines name the VE's address; the
PD's vLLM keeps an item it read, so each image crosses once). EPD_NIXL3_VLLM (a comma list, default
all three) runs a subset: EPD_NIXL3_VLLM=0.32.0 EPD_REAL_TIER=1 scripts/test.sh tests/e2e/test_nixl_three_hosts.py

Only in the real-engine tier (`scripts/test.sh --real`, which sets EPD_REAL_TIER=1): per vLLM a first
deploy of two real vLLM engines, two engine restarts and the load take ~8-10 min, beyond the full
run's 20."""

from __future__ import annotations

import json
import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_kit.plan.neuron_releases import VLLM_CPU_VERSIONS, handoff_of
from epd_kit.plan.settings import port_range
from epd_kit.plan.variables import VARIABLES
from epd_kit.wire import EC_TRANSFER_PARAMS
from tests.e2e.access import nft_set, open_ports
from tests.e2e.conftest import deploy_stack, require_engine_wheelhouse, sandbox_inventory
from tests.e2e.stack import LoadGenerator, Stack, image_message, wait_for
from tests.e2e.test_real_engines import BLUE, GREEN, RED, chat_text, images
from tests.e2e.test_three_hosts import connect_from
from tests.hosts.harness import REPO, HostPool, TestHost, machine_address
from tests.hosts.sandbox import SandboxInventory, engine_vllm
from tests.real_engines.test_nixl_kit import READ
from tests.real_engines.upstream_pair import READ_LINE as UPSTREAM_READ

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        os.environ.get("EPD_REAL_TIER") != "1",
        reason="the real-engine tier only (~10 min: two real vLLM engines on three hosts, two restarts): "
        "scripts/test.sh --real, or alone: EPD_REAL_TIER=1 scripts/test.sh tests/e2e/test_nixl_three_hosts.py",
    ),
]

INVENTORY = "vllm-cpu-three-host"
VE_UNIT, PD_UNIT = "epd-engine@ve-0.service", "epd-engine@pd-0.service"
# the plan's epd_vllm_cpu_ucx_port_range (the inventory keeps the default)
UCX_PORTS = port_range(str(VARIABLES["epd_vllm_cpu_ucx_port_range"].default))
# a table of this test's own on n1 and n2: it counts the new connections one engine host opens to
# the other (to UCX's range, to any other port) before the kit's chain judges them
WATCH = "epd_test_syns"


# the vLLMs deployed, in this order (a stack each): EPD_NIXL3_VLLM, a comma list, runs a subset
VLLMS = [v.strip() for v in os.environ.get("EPD_NIXL3_VLLM", "0.24.0,0.32.0,0.29.0").split(",") if v.strip()]
if unknown := [v for v in VLLMS if v not in VLLM_CPU_VERSIONS]:
    raise pytest.UsageError(f"EPD_NIXL3_VLLM: {unknown} not among the vllm-cpu versions {list(VLLM_CPU_VERSIONS)}")


@pytest.fixture(scope="module", params=VLLMS, ids=[f"vllm{v}" for v in VLLMS])
def stack(request, host_pool: HostPool, record_timing, tmp_path_factory) -> Stack:
    vllm = request.param
    assert engine_vllm(SandboxInventory.load(REPO / "inventory/sandbox" / INVENTORY)), f"{INVENTORY}: not vllm-cpu"
    label = f"nixl 3 hosts {vllm}"
    require_engine_wheelhouse(vllm, record_timing, label)
    inventory = sandbox_inventory(INVENTORY, tmp_path_factory)
    (inventory / "group_vars/all/vllm.yml").write_text(f'---\nepd_vllm_cpu_vllm: "{vllm}"\n')
    deployed = deploy_stack(host_pool, inventory, record_timing, label)
    assert vllm_of(deployed) == vllm, deployed.inventory.group_vars
    watch_connections(deployed.hosts["n2"], machine_address(1))
    watch_connections(deployed.hosts["n1"], machine_address(2))
    return deployed


def watch_connections(host: TestHost, source: str) -> None:
    """Count the SYNs `source` sends to `host`: to UCX's range and to any other port (no verdict:
    the kit's table still judges each)."""
    first, last = UCX_PORTS[0], UCX_PORTS[-1]
    syn = f"ip saddr {source} tcp flags & (fin | syn | rst | ack) == syn"
    host.run(
        f"nft -f - <<'EOF'\ntable inet {WATCH} {{\n counter ucx {{}}\n counter other {{}}\n chain input {{\n"
        "  type filter hook input priority filter - 10; policy accept;\n"
        f"  {syn} tcp dport {first}-{last} counter name ucx\n"
        f"  {syn} tcp dport != {first}-{last} counter name other\n }}\n}}\nEOF"
    )


def connections(host: TestHost) -> dict[str, int]:
    """{"ucx": n, "other": n}: the SYNs watch_connections counted on `host` so far."""
    out = json.loads(host.run(f"nft -j list table inet {WATCH}").stdout)
    return {item["counter"]["name"]: int(item["counter"]["packets"]) for item in out["nftables"] if "counter" in item}


def vllm_of(stack: Stack) -> str:
    return str(engine_vllm(stack.inventory))


def upstream(stack: Stack) -> bool:
    """vLLM >= 0.30: upstream's hand-off and connector (its READ lines name the VE's address)."""
    return handoff_of(vllm_of(stack)) == EC_TRANSFER_PARAMS


def engine_ids(stack: Stack) -> tuple[str, str]:
    """The router's ids of the one VE and the one PD."""
    pools = stack.pools()
    (ve,) = [e["id"] for e in pools if e["role"] == "ve"]
    (pd,) = [e["id"] for e in pools if e["role"] == "pd"]
    return ve, pd


def reads(stack: Stack) -> list[tuple[str, int, str, float]]:
    """The PD connector's READ lines in n2's journal: (item, bytes, from, read ms); from: the VE's
    engine id (the kit's connector) or its address (upstream's)."""
    journal = stack.hosts["n2"].journal(PD_UNIT, lines=20000)
    if upstream(stack):
        return [(h, int(n), host, float(ms)) for h, n, host, _port, ms, _ack in UPSTREAM_READ.findall(journal)]
    return [(h, int(n), e, float(ms)) for h, n, _blocks, e, ms, _all in READ.findall(journal)]


def diagnostics(stack: Stack) -> str:
    """What the engines and the router logged about reads, failures and health (for a failure)."""
    wanted = ("NIXL", "nixl", "UCX", "ECLoad", "rror", "ejected", "readmit", "retrying", "quarantin", "probe")
    out = []
    for host, unit in (("n1", VE_UNIT), ("n2", PD_UNIT), ("n3", "epd-router@0.service")):
        lines = [
            line for line in stack.hosts[host].journal(unit, lines=3000).splitlines() if any(w in line for w in wanted)
        ]
        out.append(f"--- {host} {unit} (last {min(len(lines), 60)} of {len(lines)} matching lines)")
        out += [line[:400] for line in lines[-60:]]
    return "\n".join(out)


def thread_dump(host: TestHost, unit: str, process: str) -> str:
    """Where `process` (the engine's process holding the NIXL agent) waits: each of its threads' state
    and CPU, twice 2 s apart, and its Python stacks (SIGUSR2: faulthandler, nixl_agent.py), from the
    journal. Only a process that catches SIGUSR2 is signalled (its default would end it)."""
    threads = f"ps -Lo pid,tid,stat,pcpu,time,wchan:28,comm -p \"$(pgrep -d, -x '{process}')\""
    out = [host.run(f"{threads}; sleep 2; {threads}", check=False).stdout]
    out.append(
        host.run(
            f"for p in $(pgrep -x '{process}'); do c=$(awk '/SigCgt/{{print $2}}' /proc/$p/status); "
            f'[ $(( 0x$c & 0x800 )) -ne 0 ] && kill -USR2 $p && echo "SIGUSR2 to $p"; done; sleep 2; '
            f"journalctl --no-pager -q -o cat --since -5s -u {unit} | grep -E 'Thread 0x|most recent call|  File'",
            check=False,
        ).stdout
    )
    return "\n".join(out)


def rx_bytes(host: TestHost) -> int:
    """Bytes received on every interface of `host` but loopback."""
    out = host.run("for i in /sys/class/net/*; do [ ${i##*/} = lo ] || cat $i/statistics/rx_bytes; done").stdout
    return sum(int(n) for n in out.split())


def engine_failures(stack: Stack) -> dict[str, float]:
    """epd_router_engine_failures per engine id, from the router's /metrics."""
    with stack.http(10) as http:
        text = http.get("/metrics").text
    return {
        s.labels["engine"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "epd_router_engine_failures"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_images_cross_from_the_ve_host_to_the_pd_host_over_nixl(stack: Stack, record_timing):
    ve, _pd = engine_ids(stack)
    n2 = stack.hosts["n2"]
    before, rx_before = len(reads(stack)), rx_bytes(n2)
    started = time.monotonic()
    red = stack.chat(image_message("What is in the picture?", RED), max_tokens=8)
    label = f"nixl 3 hosts {vllm_of(stack)}"
    record_timing(f"{label}: one image chat through the router", time.monotonic() - started)
    assert red.choices[0].message.content and red.usage.prompt_tokens > 0
    streamed, last = stack.chat_stream(image_message("What is in the picture?", BLUE))
    assert streamed and last.usage is not None and last.usage.completion_tokens > 0
    two = chat_text(stack, images("Compare the two pictures.", RED, GREEN))
    assert two.choices[0].message.content
    again = stack.chat(image_message("What is in the picture?", RED), max_tokens=8)
    assert again.choices[0].message.content
    # every image crosses at least once (red, blue, green); the kit's connector reads a repeated one
    # again unless the PD's vLLM encoder cache still holds it (2026-12-06 on n2: the fourth chat's
    # red was not read, the two-image chat's had just been), upstream's PD keeps an item it read
    # (test_nixl_upstream_router): 3 to 5 READ lines
    new = wait_for(
        lambda: reads(stack)[before:] if len({item for item, *_ in reads(stack)[before:]}) >= 3 else None,
        timeout=30,
        what="READ lines of the three images in n2's journal",
    )
    assert 3 <= len(new) <= (3 if upstream(stack) else 5), new
    source = machine_address(1) if upstream(stack) else ve
    assert {where for _, _, where, _ in new} == {source}, new
    assert all(nbytes > 0 for _, nbytes, _, _ in new), new
    # the bytes came over n2's network, not a shared file: its interfaces received at least them
    assert rx_bytes(n2) - rx_before >= sum(nbytes for _, nbytes, *_ in new)
    record_timing(f"{label}: bytes per image read over NIXL", max(n for _, n, *_ in new), "bytes")
    record_timing(f"{label}: bytes read over NIXL n1 -> n2 in all", sum(n for _, n, *_ in new), "bytes")
    record_timing(f"{label}: slowest NIXL read", max(ms for *_, ms in new) / 1000)
    print(f"new connections n1 -> n2 {connections(n2)}, n2 -> n1 {connections(stack.hosts['n1'])}")
    # red (read first) and blue are two items, and green a third
    assert len({item for item, *_ in new}) == 3 and new[0][0] != new[1][0], new


def test_the_ucx_ports_and_side_channel_open_from_the_pd_host_only(stack: Stack):
    hosts = stack.hosts
    n1, n2 = machine_address(1), machine_address(2)
    assert nft_set(hosts["n1"], "side_channel_v4") == [n2]
    assert nft_set(hosts["n1"], "ucx_v4") == [n2]
    assert nft_set(hosts["n2"], "engine_http_v4") == [machine_address(3)]
    # the VE's UCX listener (the port UCX took from the plan's range, after the reads above)
    listening = hosts["n1"].run("ss -Hltn").stdout
    ucx = sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in listening.splitlines()} & set(UCX_PORTS))
    assert ucx, listening
    assert connect_from(hosts["n2"], n1, ucx[0]) == "open"
    assert connect_from(hosts["n3"], n1, ucx[0]) == "refused"
    assert connect_from(hosts["n2"], n1, 14600) == "open"
    assert connect_from(hosts["n3"], n1, 14600) == "refused"
    # nothing else new: from the controller only SSH and the router answer, the UCX port included,
    # and every listener the plan never opened (the engines' torch.distributed store, the PD's UCX)
    found = {name: open_ports(host) for name, host in hosts.items()}
    for name in ("n1", "n2"):  # who listens there, for the record (docs/security.md says why)
        print(f"{name} listeners:\n" + hosts[name].run("ss -Hltnp").stdout)
    assert found == {"n1": [22], "n2": [22], "n3": [22, 18800]}, found


def kill_under_load(stack: Stack, host: str, unit: str, engine: str, record_timing) -> tuple[object, object]:
    """SIGKILL `unit`'s main process while bounded load flows; wait for the router to see it down,
    for systemd's restart and the router's readmission. The load during the window, then a second
    bounded load after it (every request must be answered)."""
    target = stack.hosts[host]
    before = target.show(unit, "MainPID")["MainPID"]
    opened = {name: connections(stack.hosts[name]) for name in ("n1", "n2")}
    with LoadGenerator(stack.router_url, stack.model_id(), rate_per_s=2, max_requests=600, max_seconds=400) as during:
        during.answered(2, timeout=60)
        killed = time.monotonic()
        target.run(f"kill -9 {before}")
        stack.wait_engine_health(engine, False, timeout=30)
        label = f"nixl 3 hosts {vllm_of(stack)}"
        record_timing(f"{label}: SIGKILL of {engine} to marked down", time.monotonic() - killed)
        wait_for(
            lambda: (
                (s := target.show(unit, "MainPID", "ActiveState"))["ActiveState"] == "active"
                and s["MainPID"] not in ("0", before)
            ),
            timeout=300,
            what=f"systemd to restart {unit} (a real vLLM start)",
        )
        stack.wait_engine_health(engine, True, timeout=120)
        record_timing(f"{label}: SIGKILL of {engine} to readmitted", time.monotonic() - killed)
        window = during.stop()
    record_timing(f"{label}: failed requests while {engine} was down", len(window.failures), "requests")
    with LoadGenerator(stack.router_url, stack.model_id(), rate_per_s=2, max_requests=40, max_seconds=60) as after:
        after.answered(10, timeout=120)
        outcome = after.stop()
    grown = {}
    for name, peer in (("n2", "n1"), ("n1", "n2")):  # who opened connections to whom, for the record
        now = connections(stack.hosts[name])
        grown[name] = {k: now[k] - opened[name].get(k, 0) for k in now}
        between = stack.hosts[name].run(f"ss -Htn dst {machine_address(int(peer[1:]))}").stdout
        print(f"{peer} -> {name}: new connections while {engine} restarted {grown[name]}, all {now}; open:\n{between}")
    # the VE host opens nothing to the PD host, UCX's answers to READs included (they ride the PD's
    # connection: docs/security.md "Who can reach what"); 0 in each of issue 54's three runs
    assert grown["n2"] == {"ucx": 0, "other": 0}, grown
    if not (outcome.sent >= 10 and outcome.ok == outcome.sent):
        print(diagnostics(stack))
        print("--- n1's VE worker\n" + thread_dump(stack.hosts["n1"], VE_UNIT, "VLLM::Worker"))
        print("--- n2's PD engine core\n" + thread_dump(stack.hosts["n2"], PD_UNIT, "VLLM::EngineCor"))
    assert outcome.sent >= 10 and outcome.ok == outcome.sent, (
        f"{len(outcome.failures)} of {outcome.sent} failed after {engine} was readmitted",
        outcome.failures[:10],
    )
    return window, outcome


def test_a_sigkilled_ve_mid_load_is_charged_and_no_request_fails_once_readmitted(stack: Stack, record_timing):
    ve, pd = engine_ids(stack)
    failures = engine_failures(stack)
    window, _after = kill_under_load(stack, "n1", VE_UNIT, ve, record_timing)
    charged = engine_failures(stack)
    # the VE's death is the VE's: the PD is charged nothing for it
    assert charged.get(pd, 0) == failures.get(pd, 0), (failures, charged, window.failures[:10])
    if window.failures:  # a request the dead VE failed is counted against it
        assert charged.get(ve, 0) > failures.get(ve, 0), (failures, charged, window.failures[:10])
    # every failure in the window is a prompt answer that says why, never a hang
    assert all("HTTP 5" in f for f in window.failures), window.failures[:10]


def test_a_sigkilled_pd_under_load_fails_no_request_once_readmitted(stack: Stack, record_timing):
    _ve, pd = engine_ids(stack)
    window, _after = kill_under_load(stack, "n2", PD_UNIT, pd, record_timing)
    assert all("HTTP 5" in f for f in window.failures), window.failures[:10]
    # and images still cross over NIXL to the restarted PD
    before = len(reads(stack))
    assert stack.chat(image_message("After the PD's restart?", (7, 70, 170)), max_tokens=4).choices
    wait_for(lambda: len(reads(stack)) > before, timeout=30, what="a READ line from the restarted PD")
