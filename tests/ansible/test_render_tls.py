"""A fleet without HAProxy and with a certificate: render.yml writes a router.yaml whose listener
serves TLS from the PEM the router role installs, and `epd-router check-config` accepts it.
Host-free (render.yml contacts no host); the certificate comes from a sandbox CA made here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.budget import scaled
from tests.hosts.certs import SandboxCa

REPO = Path(__file__).resolve().parents[2]
ADDRESS = "10.213.0.11"


def test_router_yaml_serves_tls_when_no_haproxy_is_in_front(tmp_path):
    issued = SandboxCa(tmp_path / "ca").issue("front-door", [ADDRESS])
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {
                        "epd_model": "/models/m",
                        "epd_engine_backend": "sim",
                        "epd_tls_certificate": str(issued.certificate),
                        "epd_tls_key": str(issued.key),
                    },
                    "children": {
                        "epd_engines": {
                            "hosts": {"n1": {"epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": ADDRESS}}
                        },
                        "epd_router": {"hosts": {"n1": {}}},
                    },
                }
            }
        )
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "playbooks/render.yml",
         "-e", f"render_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(300), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    config = out / "n1/etc/epd/router.yaml"
    assert yaml.safe_load(config.read_text())["listen"]["tls"] == {"certificate": "/etc/epd/tls/front-door.pem"}
    check = subprocess.run(
        [str(Path(sys.executable).parent / "epd-router"), "check-config", str(config)],
        capture_output=True, text=True, timeout=scaled(60), check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
