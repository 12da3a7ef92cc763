"""Every playbook that reads the inventory refuses a mistake on the controller before any host is
contacted (docs/planner.md "Settings checked by their shape and by each other").

The inventory's one host is 127.0.0.1 on an SSH port nobody listens on: a check that ran only
after a play had contacted the host would show up as UNREACHABLE (and the host in the recap).
"""

from __future__ import annotations

import re
import socket

import pytest
import yaml

from tests.ansible.helpers import playbook

pytestmark = pytest.mark.ansible

# every playbook that reads the inventory; render.yml's plays run on the inventory's hosts with
# a local connection (it contacts none), the others' first play is the controller check on localhost
PLAYBOOKS = (
    "plan",
    "render",
    "deploy",
    "provision",
    "precompile",
    "loadbalancer",
    "observability",
    "rolling_restart",
    "teardown",
)
MISTAKE = "n1: epd_provision_efa_installer_sha256 is 'abc': write 64 lowercase hex digits (sha256sum's output)"


def closed_port() -> int:
    """A loopback port nobody listens on (the kernel's pick, released at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_inventory(tmp_path, **group_vars) -> str:
    groups = ("epd_engines", "epd_router", "epd_loadbalancer", "epd_monitoring", "epd_precompile")
    inventory = {
        "all": {
            "vars": {
                "epd_model": "/models/m",
                "ansible_host": "127.0.0.1",
                "ansible_port": closed_port(),
                "ansible_ssh_timeout": 5,
                **group_vars,
            },
            "children": {
                group: {"hosts": {"n1": {"epd_num_ve": 1, "epd_num_pd": 1} if group == "epd_engines" else None}}
                for group in groups
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return str(path)


def contacted_nobody(output: str) -> None:
    assert "UNREACHABLE" not in output, output[-3000:]
    recap = output[output.index("PLAY RECAP") :]
    counts = re.findall(r"^(\S+)\s+:.*unreachable=(\d+)", recap, re.MULTILINE)
    assert counts and all(unreachable == "0" for _, unreachable in counts), recap


@pytest.mark.parametrize("book", PLAYBOOKS)
def test_a_mistake_is_refused_before_any_host_is_contacted(tmp_path, book):
    inventory = write_inventory(tmp_path, epd_provision_efa_installer_sha256="abc")
    result = playbook("-i", inventory, f"playbooks/{book}.yml", "-e", f"render_dir={tmp_path / 'render'}", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert output.count(MISTAKE) == 1, output[-3000:]
    assert "the inventory check found 1 problem(s), listed above" in output
    contacted_nobody(output)
    if book != "render":  # the controller's own play: only localhost in the recap
        assert re.findall(r"^(\S+)\s+:", output[output.index("PLAY RECAP") :], re.MULTILINE) == ["localhost"]


def test_an_address_from_facts_is_explained_before_any_host_is_contacted(tmp_path):
    inventory = write_inventory(tmp_path, epd_bind_address="{{ ansible_default_ipv4.address }}")
    result = playbook("-i", inventory, "playbooks/plan.yml", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "n1: epd_bind_address cannot be resolved before any host is contacted" in " ".join(output.split())
    assert "'ansible_default_ipv4' is undefined" not in output
    contacted_nobody(output)
