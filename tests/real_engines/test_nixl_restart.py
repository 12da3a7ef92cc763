"""A restarted VE's NIXL agent, read by a PD that lived on (issue 54, the VE SIGKILL of
tests/e2e/test_nixl_three_hosts.py), with the kit's connector's two halves and no vLLM engine:
the VE's half (nixl_producer.py: ProducerRegion, its side channel, one item) in a network
namespace of its own (`s9r-rve`, 10.233.0.1), the PD's half (ConsumerReader) in this process on
the host's end of the veth (10.233.0.2), UCX over TCP as the plan sets it (UCX_TLS=tcp, the
fleet's UCX_TCP_PORT_RANGE).

The first VE's item is read; a read is in flight when the VE is SIGKILLed (as under load); a new
VE process with the same engine id and side-channel port holds another item; the reader, which
knew the first VE, must read the new VE's item, and the one after it, byte-identical, within the
connector's transfer timeout, and the VE must not connect back to the PD (the access rules open
PD -> VE only). Seconds, not minutes: the engine-level test is test_nixl_kit.py's.

Needs root and iproute2 (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from epd_kit.plan.settings import port_range
from epd_kit.plan.variables import VARIABLES

from .conftest import REPO
from .netns import End, ip, namespace_beside_host
from .nixl_producer import READY, item

NETNS, VE_LINK, PD_LINK = "s9r-rve", "s9r-r0", "s9r-r1"
VE_ADDRESS, PD_ADDRESS = "10.233.0.1", "10.233.0.2"
SIDE_PORT = 14690  # the VE's side channel (any port outside the UCX range)
UCX_PORTS = str(VARIABLES["epd_vllm_cpu_ucx_port_range"].default)  # the plan's default range
TRANSFER_TIMEOUT_S = 5.0  # the connector's default transfer_timeout_sec
START_S = 120  # the producer imports the plugin (and so vLLM's connector base): seconds on a busy machine


@pytest.fixture
def veth():
    """s9r-rve with s9r-r0 (10.233.0.1) joined to s9r-r1 (10.233.0.2) on the host; deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip netns`)")
    with namespace_beside_host(NETNS, End(NETNS, VE_LINK, VE_ADDRESS), PD_LINK, PD_ADDRESS):
        yield


class Producer:
    """nixl_producer.py in the VE's namespace, as a session leader (SIGKILL reaches it all)."""

    def __init__(self, plugin_site: Path, log: Path, seed: int) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(plugin_site), str(REPO), str(REPO / "router")]),
            "UCX_TLS": "tcp",  # as the plan sets them (plan/command.py nixl_env)
            "UCX_TCP_PORT_RANGE": UCX_PORTS,
        }
        env.pop("UCX_NET_DEVICES", None)  # the connector sets it from its address
        argv = ["ip", "netns", "exec", NETNS, sys.executable, "-m", "tests.real_engines.nixl_producer"]
        argv += ["ve-r", VE_ADDRESS, str(SIDE_PORT), str(seed)]
        self.log = log
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=log.open("ab"), text=True, start_new_session=True
        )
        self.ready: dict = {}

    def wait_ready(self) -> dict:
        """Its JSON line (it serves from then on), within START_S."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + START_S
        while True:  # vLLM's own log lines come first (its logger prints to stdout)
            while not select.select([stdout], [], [], 0.5)[0]:
                assert self.process.poll() is None, f"the producer exited: {self.log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"the producer did not serve within {START_S} s"
            line = stdout.readline()
            assert line, f"the producer exited: {self.log.read_text()[-3000:]}"
            if line.startswith(READY):
                self.ready = json.loads(line.removeprefix(READY))
                return self.ready

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def ve_to_pd_connections() -> list[str]:
    """TCP connections the VE's namespace opened to the PD's address (the VE connecting back)."""
    out = ip("netns", "exec", NETNS, "ss", "-Htn", "state", "established")
    back = []
    for line in out.splitlines():
        local, peer = line.split()[-2:]
        if peer.rsplit(":", 1)[0] == PD_ADDRESS and int(peer.rsplit(":", 1)[1]) in port_range(UCX_PORTS):
            back.append(f"{local} -> {peer}")
    return back


def test_a_pd_reads_from_a_restarted_ve_with_the_same_engine_id_and_port(veth, plugin_site, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", UCX_PORTS)
    monkeypatch.setenv("UCX_NET_DEVICES", PD_LINK)  # what the reader would set from its address, undone after
    connector = importlib.import_module("epd_vllm_plugin.nixl_connector")
    log = tmp_path / "producer.log"
    first = Producer(plugin_site, log, seed=1)
    producers = [first]
    try:
        first.wait_ready()
        config = connector.NixlECConfig("pd-r", None, None, transfer_timeout_s=TRANSFER_TIMEOUT_S)
        reader = connector.ConsumerReader(replace(config, ucx_address=PD_ADDRESS))

        def locator(ready: dict) -> dict:
            return {
                "engine_id": "ve-r",
                "host": VE_ADDRESS,
                "port": SIDE_PORT,
                "remote_block_ids": ready["blocks"],
                "num_tokens": ready["rows"],
            }

        def finish(read: object, budget: float = 3 * TRANSFER_TIMEOUT_S) -> object:
            deadline = time.monotonic() + budget
            while (loaded := reader.poll(read)) is None:
                assert time.monotonic() < deadline, f"the read did not end within {budget} s"
                time.sleep(0.001)
            return loaded

        def read_item(ready: dict, seed: int) -> float:
            started = time.monotonic()
            loaded = finish(reader.start(ready["mm_hash"], locator(ready)))
            import torch

            got = torch.frombuffer(bytearray(loaded.data), dtype=torch.bfloat16).view(loaded.shape)
            assert torch.equal(got, item(seed)), "the bytes read are not the VE's item"
            return time.monotonic() - started

        first_s = read_item(first.ready, 1)
        # a read in flight when the VE dies (the e2e test kills it under load): it fails, bounded
        in_flight = reader.start(first.ready["mm_hash"], locator(first.ready))
        first.kill()
        with contextlib.suppress(connector.ECLoadFailure):
            finish(in_flight)

        second = Producer(plugin_site, log, seed=2)
        producers.append(second)
        second.wait_ready()
        assert second.ready["agent"] != first.ready["agent"]
        after_s = [read_item(second.ready, 2) for _ in range(3)]
        assert max(after_s) < TRANSFER_TIMEOUT_S, (first_s, after_s)
        assert reader.stats["handshakes"] == 2, reader.stats
        assert not ve_to_pd_connections(), "the VE connected back to the PD (the access rules drop that)"
        after_ms = [round(s * 1000, 1) for s in after_s]
        print(f"restart figures: first VE read {first_s * 1000:.1f} ms, new VE reads {after_ms} ms")
    finally:
        for producer in producers:
            producer.kill()
