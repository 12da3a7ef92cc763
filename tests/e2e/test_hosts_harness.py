"""The test hosts themselves: real systemd, sshd, the DLAMI-like base, isolation."""

from __future__ import annotations

import pytest

from tests.hosts.harness import HUB_NETNS, ansible_playbook, hosts_env, run

pytestmark = pytest.mark.systemd


def test_host_runs_systemd_and_sshd(test_hosts):
    (n1,) = test_hosts(1)
    assert n1.systemctl("is-system-running", check=False).stdout.strip() in {"running", "degraded"}
    assert n1.is_active("ssh.service") == "active"
    assert n1.ssh("hostname").stdout.strip() == "n1"
    assert n1.run("cat /etc/hostname").stdout.strip() == "n1"


def test_base_image_is_a_dlami_stand_in_without_the_kit(host_pool, test_hosts):
    # a pristine host: an earlier module may have deployed the kit on the shared n1
    n1 = host_pool.reset(test_hosts(1)[0])
    n1.run("python3 -m venv /tmp/probe-venv && /tmp/probe-venv/bin/python -c 'import ssl'")
    n1.run("test -e /usr/lib/x86_64-linux-gnu/libfabric.so.1 && command -v curl")
    assert n1.run("test -e /opt/epd || id epd", check=False).returncode != 0, "kit leaked into the base image"


def test_hosts_are_isolated(test_hosts):
    """Checked structurally: no packet is sent to any address outside the test hosts."""
    (n1,) = test_hosts(1)
    # the hub namespace holds only lo, the bridge and the hosts' veths, and has no default route
    links = run(["ip", "-n", HUB_NETNS, "-o", "link"]).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    assert names <= {"lo", "kitbr0"} | {n for n in names if n.startswith("vb-")}, names
    assert "default" not in run(["ip", "-n", HUB_NETNS, "route"]).stdout
    # inside a host: only 10.213.0.0/24 exists; everything else would go to the hub bridge (.1)
    assert "via 10.213.0.1 dev host0" in n1.run("ip route get 192.0.2.1").stdout
    # the safety route: any other 10.213 address is unreachable, locally, in both namespaces
    assert run(["ip", "route", "get", "10.213.1.50"], check=False).returncode != 0
    assert run(["ip", "-n", HUB_NETNS, "route", "get", "10.213.1.50"], check=False).returncode != 0


def test_ansible_reaches_hosts_over_ssh(test_hosts, tmp_path):
    hosts = test_hosts(2)
    key = hosts[0].ssh_key
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[nodes]\n"
        + "".join(f"{h.name} ansible_host={h.address}\n" for h in hosts)
        + "[nodes:vars]\nansible_user=root\n"
        f"ansible_ssh_private_key_file={key}\n"
        "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'\n"
        "ansible_python_interpreter=/usr/bin/python3\n"
    )
    playbook = tmp_path / "ping.yml"
    playbook.write_text(
        "- hosts: nodes\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.ping:\n"
        "    - ansible.builtin.command: systemctl is-system-running\n"
        "      register: state\n      changed_when: false\n"
        "      failed_when: state.stdout not in ['running', 'degraded']\n"
    )
    result = ansible_playbook(inventory, str(playbook))
    assert result.returncode == 0, result.describe()
    assert set(result.recap) == {"n1", "n2"} and result.changed == 0


def test_reset_gives_a_pristine_host(host_pool, test_hosts):
    (n1,) = test_hosts(1)
    n1.run("touch /root/dirty")
    n1 = host_pool.reset(n1)
    assert n1.run("test -e /root/dirty", check=False).returncode != 0


def test_the_hub_bridge_keeps_its_mac_when_a_host_leaves(host_pool, test_hosts):
    # A bridge without a MAC of its own takes its lowest port's, so a host leaving could change it,
    # and every other host would lose the hub (the controller's 10.213.0.1) until its ARP entry
    # for it expired: a provisioning test's downloads "timed out" while the other lane stopped hosts.
    n1, n2 = test_hosts(2)
    env = hosts_env()

    def bridge(attribute: str) -> str:
        path = f"/sys/class/net/{env['BR']}/{attribute}"
        return run(["ip", "netns", "exec", HUB_NETNS, "cat", path]).stdout.strip()

    assert bridge("addr_assign_type") == "3", "the bridge's MAC is not set by hosts.sh (NET_ADDR_SET)"
    assert bridge("address") == env["BRIDGE_MAC"]
    host_pool.down(n2)
    assert bridge("address") == env["BRIDGE_MAC"]
    n1.ssh("true")  # traffic from the hub: n1 answers it through its ARP entry for the hub
    gateway = n1.run("ip route show default").stdout.split()[2]
    assert f"lladdr {env['BRIDGE_MAC']}" in n1.run(f"ip neigh show {gateway}").stdout
