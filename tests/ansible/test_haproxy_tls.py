"""The HAProxy role's configuration with TLS on, run by Debian's own haproxy (the .deb the sandbox
installs, unpacked here) on 127.0.0.1, with the PEM the roles install (templates/front-door.pem.j2,
rendered by ansible-playbook from the operator's pair or bundle): the check the role's `validate:`
runs passes, the client port speaks TLS only, the redirect port answers 308 to https. Host-free;
skipped where `tests/hosts/hosts.sh prepare` has not fetched the .deb files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jinja2
import pytest
from ansible.plugins.filter.core import to_bool

from epd_kit.testing.process import free_port
from tests.budget import scaled
from tests.hosts.certs import SandboxCa, trust
from tests.hosts.harness import REPO, hosts_env

TEMPLATE = REPO / "roles/epd_haproxy/templates/haproxy.cfg.j2"


@pytest.fixture(scope="module")
def haproxy(tmp_path_factory) -> tuple[list[str], dict[str, str]]:
    debs = sorted((Path(hosts_env()["KIT_DIR"]) / "haproxy-debs").glob("*.deb"))
    if not any(d.name.startswith("haproxy_") for d in debs):
        pytest.skip("no haproxy .deb: `tests/hosts/hosts.sh prepare` fetches them")
    root = tmp_path_factory.mktemp("haproxy")
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    libs = f"{root}/usr/lib/x86_64-linux-gnu:{root}/lib/x86_64-linux-gnu"
    return [str(root / "usr/sbin/haproxy")], {**os.environ, "LD_LIBRARY_PATH": libs}


def front_door_pems(directory: Path, forms: dict[str, dict[str, str]]) -> dict[str, Path]:
    """The PEM the roles write (their tasks' content), rendered by Ansible once per form of the
    operator's files (a pair, a bundle): one play, one task each."""
    pems = {name: directory / f"{name}.pem" for name in forms}
    template = REPO / "templates/front-door.pem.j2"
    tasks = [
        {
            "ansible.builtin.copy": {
                "content": "{{ lookup('ansible.builtin.template', '" + str(template) + "') }}",
                "dest": str(pems[name]),
                "mode": "0600",
            },
            "vars": tls,
        }
        for name, tls in forms.items()
    ]
    playbook = directory / "pem.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable})],
        capture_output=True, text=True, timeout=scaled(120), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    return pems


def render(tls_file: Path, port: int, redirect_port: int | None) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = to_bool
    text = env.from_string(TEMPLATE.read_text()).render(
        ansible_managed="test",
        epd_haproxy_maxconn=100,
        epd_haproxy_tls=True,
        epd_haproxy_tls_file=str(tls_file),
        epd_haproxy_timeout_connect_ms=200,
        epd_haproxy_timeout_client_s=5,
        epd_haproxy_timeout_server_s=5,
        epd_haproxy_timeout_keep_alive_s=5,
        epd_haproxy_check_timeout_ms=200,
        epd_haproxy_bind_address="127.0.0.1",
        epd_haproxy_port=port,
        epd_haproxy_http_redirect_port=redirect_port,
        epd_haproxy_check_inter_ms=1000,
        epd_haproxy_check_fall=2,
        epd_haproxy_check_rise=2,
        epd_haproxy_routers=[{"name": "n1", "address": "127.0.0.1", "port": free_port()}],  # nothing there: 503
        epd_haproxy_stats_port=None,
    )
    # not root here: no user switch, no syslog, no admin socket under /run
    for line in ("log /dev/log local0 notice", "user haproxy", "group haproxy", "stats socket /run/haproxy/"):
        text = "\n".join(row for row in text.splitlines() if line not in row)
    return text + "\n"


def test_tls_only_on_the_client_port_and_a_redirect_from_the_plain_one(haproxy, tmp_path):
    binary, env = haproxy
    ca = SandboxCa(tmp_path / "ca")
    issued = ca.issue("front-door", ["127.0.0.1"])
    pems = front_door_pems(
        tmp_path,
        {
            "pair": {"epd_tls_certificate": str(issued.certificate), "epd_tls_key": str(issued.key)},
            "bundle": {"epd_tls_bundle": str(issued.bundle)},
        },
    )
    for pem in pems.values():  # chain, then key, each PEM block whole
        assert pem.read_bytes() == issued.bundle.read_bytes(), pem.name
    port, redirect = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(render(pems["pair"], port, redirect))
    check = subprocess.run([*binary, "-c", "-f", str(config)], env=env, capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    process = subprocess.Popen(
        [*binary, "-db", "-f", str(config)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                answer = httpx.get(f"https://127.0.0.1:{port}/ready", verify=trust(ca), timeout=2)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline and process.poll() is None, "haproxy did not start"
                time.sleep(0.1)
        assert answer.status_code == 503  # through TLS to the (absent) router: HAProxy's own answer
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
        moved = httpx.get(f"http://127.0.0.1:{redirect}/v1/models?x=1", timeout=2)
        assert moved.status_code == 308 and moved.headers["location"] == f"https://127.0.0.1:{port}/v1/models?x=1"
    finally:
        process.kill()
        process.wait(10)
