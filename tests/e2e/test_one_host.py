"""One host (inventory/sandbox/one-host: 1 VE + 2 PD + router on n1), deployed with the real
playbook over SSH, driven with systemctl and the real openai client. Tests run in file
order on one deployment; each leaves the stack as it found it, except the last (teardown)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.stack import image_message, is_healthy, wait_for
from tests.hosts.harness import ansible_playbook

pytestmark = pytest.mark.systemd

ENGINES = {
    "epd-engine@pd-0.service": "epd-pd-0",
    "epd-engine@pd-1.service": "epd-pd-1",
    "epd-engine@ve-0.service": "epd-ve-0",
}
RED, BLUE = (200, 30, 30), (30, 30, 200)
# everything the kit writes on a host (teardown must remove all of it; --check must touch none)
KIT_FILES = (
    "/etc/epd /etc/systemd/system/epd-engine@.service /etc/systemd/system/epd-router.service "
    "/etc/systemd/system/epd-router.socket /etc/systemd/system/epd-router@.service "
    "/etc/systemd/system/epd-engines.target /etc/systemd/system/epd.target"
)


def kit_state(host) -> str:
    """Content hashes of the kit's files plus the main PID of every kit unit."""
    files = host.run(f"find {KIT_FILES} -type f 2>/dev/null | sort | xargs -r sha256sum", check=False).stdout
    # the router's process units (epd-router.service groups them and has no main process)
    pids = "\n".join(f"{u}={host.show(u, 'MainPID')['MainPID']}" for u in [*ENGINES, "epd-router@0.service"])
    return files + pids


def test_deploy_starts_every_unit_and_the_router_sees_all_engines(one_host_stack):
    n1 = one_host_stack.hosts["n1"]
    for unit in [*ENGINES, "epd-router.service", "epd-engines.target", "epd.target"]:
        assert n1.is_active(unit) == "active", f"{unit}:\n{n1.journal(unit)}"
    # enabled = the stack comes back after a reboot (ask inside the host: see docs/sandbox.md)
    enabled = n1.run(
        "systemctl is-enabled epd.target epd-engines.target epd-router.service " + " ".join(ENGINES)
    ).stdout.split()
    assert set(enabled) == {"enabled"}, enabled
    pools = {e["id"]: e for e in one_host_stack.pools()}
    assert set(pools) == set(ENGINES.values())
    assert all(is_healthy(e) for e in pools.values()), pools
    # the exact command is on the host: unit + env file
    env = n1.run("cat /etc/epd/engines/pd-0.env").stdout
    assert "/models/tiny-qwen3-vl" in env and "NEURON_VISIBLE_DEVICES" in env
    assert n1.run("systemctl cat epd-engine@pd-0.service").stdout.count("--no-enable-prefix-caching") == 1


def test_text_image_and_streaming_requests(one_host_stack):
    stack = one_host_stack
    text = stack.chat([{"role": "user", "content": "Say hello to the sandbox."}], max_tokens=8)
    assert text.choices[0].message.content and text.choices[0].finish_reason in ("length", "stop")
    assert text.usage.completion_tokens <= 8

    red = stack.chat(image_message("What is in the picture?", RED), max_tokens=16)
    red_again = stack.chat(image_message("What is in the picture?", RED), max_tokens=16)
    blue = stack.chat(image_message("What is in the picture?", BLUE), max_tokens=16)
    # the sim's output is a deterministic function of the prompt AND the image embeddings:
    # same image, same answer; another image, another answer (the embedding reached the PD)
    assert red.choices[0].message.content == red_again.choices[0].message.content
    assert red.choices[0].message.content != blue.choices[0].message.content
    assert red.usage.prompt_tokens > text.usage.prompt_tokens  # image tokens are in the prompt

    stream = stack.openai().chat.completions.create(
        model=stack.model_id(),
        messages=image_message("What is in the picture?", RED),
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == red.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == red.usage.completion_tokens


def test_stopping_one_pd_keeps_serving_and_it_rejoins_on_start(one_host_stack):
    stack, n1 = one_host_stack, one_host_stack.hosts["n1"]
    n1.systemctl("stop", "epd-engine@pd-1.service")
    assert n1.is_active("epd-engine@pd-1.service") == "inactive"
    for i in range(8):
        reply = stack.chat(image_message(f"while pd-1 is stopped #{i}", RED), max_tokens=4)
        assert reply.choices[0].message.content is not None
    stack.wait_engine_health("epd-pd-1", False, timeout=30)
    assert n1.is_active("epd-engines.target") == "active"  # one stopped engine does not take the pool down

    n1.systemctl("start", "epd-engine@pd-1.service", timeout=120)  # returns once /health is 200
    assert n1.is_active("epd-engine@pd-1.service") == "active"
    stack.wait_engine_health("epd-pd-1", True, timeout=30)
    for i in range(4):
        assert stack.chat(image_message(f"after pd-1 rejoined #{i}", BLUE), max_tokens=4).choices


def test_kill_9_restarts_the_engine_and_the_router_readmits_it(one_host_stack):
    stack, n1 = one_host_stack, one_host_stack.hosts["n1"]
    unit = "epd-engine@pd-0.service"
    before = n1.show(unit, "MainPID", "NRestarts")
    n1.run(f"kill -9 {before['MainPID']}")
    # RestartSec (10 s) outlasts the router's health probes (2 x 2 s): it ejects pd-0 first ...
    stack.wait_engine_health("epd-pd-0", False, timeout=15)
    for i in range(3):  # ... and serves meanwhile with pd-1
        assert stack.chat(image_message(f"while pd-0 is down #{i}", BLUE), max_tokens=4).choices
    after = wait_for(
        lambda: (
            (s := n1.show(unit, "MainPID", "NRestarts", "ActiveState"))["ActiveState"] == "active"
            and s["MainPID"] not in ("0", before["MainPID"])
            and s
        ),
        timeout=90,
        what=f"systemd to restart {unit}",
    )
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert n1.run(f"journalctl -q --no-pager -u {unit} | grep -c 'status=9/KILL'").stdout.strip() == "1"
    stack.wait_engine_health("epd-pd-0", True, timeout=60)  # readmitted
    for i in range(6):
        assert stack.chat(image_message(f"after kill -9 #{i}", RED), max_tokens=4).choices


def test_each_configuration_compiled_once_into_the_kits_cache(one_host_stack):
    """Every start so far (deploy, stop/start, kill -9) went through the plugin's cache root under
    the kit's directory: the two PDs share a configuration, so the host compiled two graphs (PD,
    VE) once each, and every later start was a local hit (docs/sim.md "Compile cache")."""
    n1 = one_host_stack.hosts["n1"]
    local = "/var/cache/epd/neuron-compile-cache/neuron/compile_cache"
    keys = n1.run(f"find {local} -mindepth 1 -maxdepth 1 -type d -user epd -name '????????????????????????????????'")
    assert len(keys.stdout.split()) == 2, keys.stdout
    log = n1.run("journalctl -q --no-pager -o cat -u 'epd-engine@*'").stdout
    assert log.count("Compile cache miss: compiling graph") <= 2, log[-3000:]  # at most once per key
    assert log.count("Compilation finished. Graph") >= 4  # 3 engines + the kill -9 restart
    assert "Compile cache hit (local" in log


def test_check_mode_changes_nothing(one_host_stack, record_timing):
    """A second deploy in check mode predicts no change on a host that runs the engines and the
    router side by side (the targets both roles write among them). That a real second deploy
    changes nothing is test_day2's last step, on four hosts after every day-2 change."""
    n1 = one_host_stack.hosts["n1"]
    before = kit_state(n1)
    start = time.monotonic()
    result = ansible_playbook(one_host_stack.inventory.directory, "playbooks/deploy.yml", "--check", "--diff")
    record_timing("1 host: re-deploy in check mode (--check --diff)", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    assert result.recap["n1"]["changed"] == 0, result.describe()
    assert kit_state(n1) == before


def test_teardown_leaves_the_host_clean(one_host_stack):
    n1 = one_host_stack.hosts["n1"]
    cache = "/var/cache/epd/neuron-compile-cache"
    n1.run(f"mkdir -p {cache}/m && echo neff > {cache}/m/model.neff")
    result = ansible_playbook(one_host_stack.inventory.directory, "playbooks/teardown.yml")
    assert result.returncode == 0, result.describe()
    # the compile cache outlives a teardown (the next deploy would cold-compile) ...
    assert n1.run("ls -A /var/cache/epd").stdout.split() == ["neuron-compile-cache"]
    assert n1.run(f"cat {cache}/m/model.neff").stdout.strip() == "neff"
    # ... unless purged
    result = ansible_playbook(
        one_host_stack.inventory.directory, "playbooks/teardown.yml", "-e", "epd_teardown_purge_cache=true"
    )
    assert result.returncode == 0, result.describe()
    assert n1.units("epd*") == [], n1.units("epd*")
    leftovers = n1.run(
        "ls -d /etc/epd /var/cache/epd /etc/systemd/system/epd* "
        "/etc/systemd/system/*.wants/epd* 2>/dev/null; getent passwd epd; getent group epd; true"
    ).stdout
    assert leftovers.strip() == "", f"teardown left: {leftovers}"
    assert n1.run("pgrep -f 'epd-(sim|router)'", check=False).returncode != 0
    assert (
        n1.run("test -e /models/tiny-qwen3-vl/config.json", check=False).returncode == 0
    )  # never the operator's model
