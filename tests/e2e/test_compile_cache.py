"""The shared compile cache tier for real (docs/operations.md "Compile cache"): two hosts that mount
one file system at the same path (hosts.sh SHARED=, the sandbox's NFS/FSx share). n1 is the
precompile host (group epd_precompile) and runs the router; n2 runs the engines (1 VE + 2 PD) in
strict mode (epd_compile_cache_strict: the engines never compile, a key missing from both tiers
fails their start). The sim compiles for a few seconds (EPD_SIM_COMPILE_S).

The operator's steps, in order: create the directory on the share, install the kit and its user
(deploy.yml --tags deps), give the directory to that user, playbooks/precompile.yml on n1 (each
compile a transient service the play stops once it answers /health; a venv unlike the fleet's is
refused before compiling), then the deploy. Then, under
bounded load with every request counted, a PD setting the precompile did not produce: the PD
canary fails at start with the engine's own message (naming it and the remedy) in the deploy's
output, the rollout stops before its second batch, and the fleet keeps serving (0 failed).
Tests run in file order on one deployment."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest
import yaml

from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import Fleet, LoadGenerator, Stack, engine_pids, image_message, is_healthy
from tests.hosts.harness import REPO, HostPool, PlaybookResult, TestHost, ansible_playbook, host_address

# boot + kit install + precompile + deploy + a failing rollout on a loaded 2-core machine
pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1200)]

MOUNT = "/mnt/fsx"  # where both hosts see the sandbox's shared file system
SHARED = f"{MOUNT}/neuron-cache"  # epd_compile_cache_shared_dir (a directory on the share, as on FSx)
LOCAL = "/var/cache/epd/neuron-compile-cache/neuron/compile_cache"  # the engine host's local tier
COMPILE_S = "3"  # the sim's compile time: a compile on n2 would show in the journal either way
KEY = re.compile(r"[0-9a-f]{32}")
SANDBOX = REPO / "inventory/sandbox/three-host"


@dataclass
class CacheFleet:
    stack: Stack
    fleet: Fleet
    precompile: PlaybookResult


def hosts_yml() -> dict:
    n1, n2 = host_address(1), host_address(2)
    return {
        "all": {
            "children": {
                "epd_engines": {
                    "hosts": {
                        "n2": {
                            "ansible_host": n2,
                            "epd_bind_address": n2,
                            "epd_num_ve": 1,
                            "epd_num_pd": 2,
                            "epd_core_count": 24,  # 2 PD tp8 + 1 VE tp4
                        }
                    }
                },
                "epd_router": {"hosts": {"n1": {"ansible_host": n1, "epd_bind_address": n1}}},
                "epd_precompile": {"hosts": {"n1": None}},
                "epd_monitoring": {"hosts": {}},
            }
        }
    }


@pytest.fixture(scope="module")
def cache(host_pool: HostPool, tmp_path_factory, record_timing) -> CacheFleet:
    sandbox_vars = yaml.safe_load((SANDBOX / "group_vars/all/epd.yml").read_text())
    fleet = Fleet(
        tmp_path_factory.mktemp("compile-cache") / "inventory",
        SANDBOX,
        hosts_yml(),
        {
            "epd_compile_cache_shared_dir": SHARED,
            "epd_compile_cache_strict": True,
            "epd_engine_environment": {**sandbox_vars["epd_engine_environment"], "EPD_SIM_COMPILE_S": COMPILE_S},
            # a strict miss fails every start the same way: let systemd give up sooner (5 starts)
            "epd_engines_restart_sec": 2,
        },
    )
    fleet.write()
    precompiled: list[PlaybookResult] = []

    def prepare(hosts: dict[str, TestHost]) -> None:
        # the operator's steps (docs/operations.md "Compile cache"): the directory on the share, the
        # kit and its user (preflight passes: the user does not exist yet), the directory to that user
        hosts["n1"].run(f"mkdir -p {SHARED}")
        start = time.monotonic()
        deps = ansible_playbook(fleet.directory, "playbooks/deploy.yml", "--tags", "deps")
        assert deps.returncode == 0, deps.describe()
        record_timing("compile cache: install the kit (--tags deps, 2 hosts)", time.monotonic() - start)
        hosts["n1"].run(f"chown epd:epd {SHARED} && chmod 0750 {SHARED}")
        uids = {name: host.run("id -u epd").stdout.strip() for name, host in hosts.items()}
        assert len(set(uids.values())) == 1, f"the engine user needs one uid on every host: {uids}"
        start = time.monotonic()
        result = ansible_playbook(fleet.directory, "playbooks/precompile.yml")
        record_timing("compile cache: precompile.yml (2 configurations)", time.monotonic() - start)
        assert result.returncode == 0, result.describe()
        precompiled.append(result)

    shared = host_pool.shared_dir("compile-cache")
    stack = deploy_stack(
        host_pool, fleet.directory, record_timing, "compile cache (2 hosts)", shared=(shared, MOUNT), prepare=prepare
    )
    return CacheFleet(stack, fleet, precompiled[0])


def flat(output: str) -> str:
    """The play's output with YAML's line wrapping undone (callback_result_format = yaml)."""
    return " ".join(output.split())


def shared_keys(host: TestHost) -> set[str]:
    out = host.run(f"ls -A {SHARED}").stdout.split()
    assert all(KEY.fullmatch(name) for name in out), out  # whole entries only: no staging left over
    return set(out)


def test_both_hosts_mount_one_file_system_that_precompile_filled_once_per_configuration(cache):
    n1, n2 = cache.stack.hosts["n1"], cache.stack.hosts["n2"]
    mounts = [host.run(f"findmnt -n -o SOURCE,FSTYPE --target {SHARED}").stdout.split() for host in (n1, n2)]
    assert mounts[0] == mounts[1] and mounts[0][1] != "overlay", mounts  # a mount of its own, the same
    # two configurations (the VE's; the PDs', shared by both), each compiled once on n1 and promoted
    keys = shared_keys(n1)
    assert len(keys) == 2 and shared_keys(n2) == keys
    assert cache.precompile.recap["n1"]["failed"] == 0
    assert flat(cache.precompile.stdout).count("(1 new)") == 2, cache.precompile.describe()
    for key in keys:
        assert n2.run(f"runuser -u epd -- test -r {SHARED}/{key}/model.neff", check=False).returncode == 0
    assert n1.units("epd-engine@*") == []  # the precompile host runs no engine


def test_the_precompile_play_stopped_each_compile_server_itself(cache):
    # no source says vllm serve exits after a CPU compile, and the sim does not: it answered
    # /health once compiled and the play stopped it (SIGTERM, the sim's own line), leaving no unit
    n1 = cache.stack.hosts["n1"]
    assert flat(cache.precompile.stdout).count("served /health after compiling; stopped by the play") == 2
    journal = n1.journal("epd-precompile-*", lines=2000)
    assert journal.count("CPU compilation complete: graph") == 2, journal[-3000:]
    assert journal.count("CPU compile mode: serving /health") == 2, journal[-3000:]
    assert journal.count("Stopped after the CPU compile (exit 0).") == 2, journal[-3000:]
    assert n1.units("epd-precompile-*") == []


def test_a_precompile_host_whose_venv_differs_from_the_fleets_is_refused_before_compiling(cache):
    # the sim backend's engine is the kit venv: one distribution more on n1 than on n2
    n1 = cache.stack.hosts["n1"]
    purelib = n1.run("/opt/epd/venv/bin/python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\"")
    probe = f"{purelib.stdout.strip()}/epd_venv_probe-0.0.1.dist-info"
    compiled = n1.journal("epd-precompile-*", lines=2000).count("CPU compilation complete")
    metadata = "Metadata-Version: 2.1\\nName: epd_venv_probe\\nVersion: 0.0.1\\n"
    n1.run(f"mkdir {probe} && printf '{metadata}' > {probe}/METADATA")
    try:
        result = ansible_playbook(cache.fleet.directory, "playbooks/precompile.yml")
    finally:
        n1.run(f"rm -rf {probe}")
    assert result.returncode != 0, result.describe()
    out = flat(result.stdout)
    assert "only on n2: none; only here: epd-venv-probe==0.0.1" in out, result.describe()
    assert "Nothing was compiled" in out
    assert n1.journal("epd-precompile-*", lines=2000).count("CPU compilation complete") == compiled


def test_a_strict_deploy_compiles_nothing_on_the_engine_host(cache):
    stack, n2 = cache.stack, cache.stack.hosts["n2"]
    units = n2.units("epd-engine@*")
    assert len(units) == 3, units
    fetched = 0
    for unit in units:
        environment = n2.show(unit, "Environment")["Environment"]
        assert "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1" in environment, environment
        assert f"NEURON_LIBTORCH_REMOTE_CACHE={SHARED}" in environment, environment
        log = n2.journal(unit)
        assert re.search(r"Compilation finished\. Graph [0-9a-f]{32}: (remote|local)", log), log[-2000:]
        fetched += log.count("fetching graph")
    assert 2 <= fetched <= 3  # each configuration fetched once (a second PD may wait and hit locally)
    assert "compiling graph" not in n2.run("journalctl -q --no-pager", check=False).stdout
    assert set(n2.run(f"ls {LOCAL}").stdout.split()) >= shared_keys(n2)
    for engine in stack.pools():
        assert is_healthy(engine) and engine["state"] == "active", engine
    reply = stack.chat(image_message("what is in the picture?", (20, 120, 200)))
    assert reply.choices[0].message.content


def test_a_setting_the_precompile_did_not_produce_fails_its_canary_and_stops_the_rollout(cache, record_timing):
    stack, fleet, n2 = cache.stack, cache.fleet, cache.stack.hosts["n2"]
    before = engine_pids(stack, ("n2",))
    fleet.group_vars["epd_max_num_seqs"] = 4  # the PD graphs change: a key the shared tier lacks
    fleet.write()
    rate = 6
    with LoadGenerator(
        stack.router_url, stack.model_id(), rate_per_s=rate, max_requests=rate * 420, max_seconds=420
    ) as load:
        load.answered()  # the load is flowing before the deploy starts
        start = time.monotonic()
        result = ansible_playbook(fleet.directory, "playbooks/deploy.yml", timeout=400)
        record_timing("compile cache: deploy whose PD canary misses the shared tier", time.monotonic() - start)
        load.answered()  # ... and still after it stopped
        outcome = load.stop()

    assert result.returncode != 0, result.describe()
    stopped = re.search(r"rollout stopped at canary batch 1 \((epd-[\w-]*?(pd-\d))\)", result.stdout)
    assert stopped, result.describe()
    canary_id, canary = stopped.groups()
    other = "pd-1" if canary == "pd-0" else "pd-0"
    # the engine's own message reaches the deploy's output: it names the engine and the remedy
    message = re.search(rf"{canary_id} on n2: (RuntimeError: Cache miss for graph [^;]*)", result.stdout)
    assert message, result.describe()
    assert f"of engine {canary_id}" in message.group(1), message.group(1)
    assert "playbooks/precompile.yml" in message.group(1) and "epd_compile_cache_strict: false" in message.group(1)
    # it failed at start, compiled nothing, and systemd gave up on it
    assert n2.is_active(f"epd-engine@{canary}.service") == "failed"
    assert "compiling graph" not in n2.run("journalctl -q --no-pager", check=False).stdout
    # no second batch: the other PD and the VE run the processes they ran, the other PD's change waits
    assert result.stdout.count("TASK [Restart the batch") == 1, result.describe()
    after = engine_pids(stack, ("n2",))
    assert after[f"n2/{other}"] == before[f"n2/{other}"] and after["n2/ve-0"] == before["n2/ve-0"], (before, after)
    assert n2.path(f"/etc/epd/engines/{other}.pending").exists()
    # the fleet kept serving: every request counted, none failed; the canary is out of rotation
    assert outcome.sent >= rate * 20, f"the load ran only {outcome.sent} requests"
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    health = {engine["id"]: is_healthy(engine) for engine in stack.pools()}
    assert len(health) == 3 and health.pop(canary_id) is False and all(health.values()), health
    reply = stack.chat(image_message("still serving?", (200, 40, 40)))
    assert reply.choices[0].message.content
