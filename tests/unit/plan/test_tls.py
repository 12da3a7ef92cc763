"""The front door's certificate, refused on the controller before any host changes
(epd_kit.plan.tls through the inventory check): each bad certificate or key is one problem that
names the variable, the file and the fix, and never carries key material."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from epd_kit import plan as planner
from tests import repo_modules
from tests.budget import scaled
from tests.hosts.certs import DAY, SandboxCa

REPO = Path(__file__).resolve().parents[3]
ADDRESS = "10.213.0.13"


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> SandboxCa:
    return SandboxCa(tmp_path_factory.mktemp("ca"))


def check(tls: dict[str, Any], *, balancer: bool = False, address: str = ADDRESS) -> list[str]:
    """The inventory check's problems for a one-engine-host fleet whose front door is its router at
    `address`, or an HAProxy host at `address`."""
    common = {"epd_model": "/models/m", **tls}
    hostvars: dict[str, dict[str, Any]] = {"n1": {**common, "epd_num_ve": 1, "epd_num_pd": 1}}
    groups = {"epd_engines": ["n1"], "epd_router": ["n1"]}
    if balancer:
        hostvars["n1"]["epd_bind_address"] = "10.213.0.11"
        hostvars["lb"] = {**common, "epd_bind_address": address}
        groups["epd_loadbalancer"] = ["lb"]
    else:
        hostvars["n1"]["epd_bind_address"] = address
    return planner.check_inventory(hostvars, groups, None, repo_modules.filters().known_variables())["problems"]


def pair(issued) -> dict[str, str]:
    return {"epd_tls_certificate": str(issued.certificate), "epd_tls_key": str(issued.key)}


def tls_lines(problems: list[str]) -> list[str]:
    # the inventory of this test has nothing else wrong with it but other checks may grow; keep ours
    return [p for p in problems if "epd_tls" in p]


@pytest.mark.parametrize("balancer", [False, True])
def test_a_good_pair_or_bundle_passes(ca, balancer):
    issued = ca.issue("good", [ADDRESS, "api.example.com"])
    assert tls_lines(check(pair(issued), balancer=balancer)) == []
    assert tls_lines(check({"epd_tls_bundle": str(issued.bundle)}, balancer=balancer)) == []


def test_an_expired_certificate_is_refused(ca):
    now = datetime.datetime.now(datetime.UTC)
    issued = ca.issue("expired", [ADDRESS], not_before=now - 30 * DAY, not_after=now - DAY)
    [line] = tls_lines(check(pair(issued)))
    assert f"epd_tls_certificate {issued.certificate}: expired on" in line and "renew" in line


def test_a_certificate_not_yet_valid_is_refused(ca):
    now = datetime.datetime.now(datetime.UTC)
    issued = ca.issue("future", [ADDRESS], not_before=now + DAY, not_after=now + 30 * DAY)
    [line] = tls_lines(check(pair(issued)))
    assert f"epd_tls_certificate {issued.certificate}: not valid before" in line


def test_a_key_of_another_certificate_is_refused(ca):
    other = ca.issue("other", [ADDRESS])
    issued = ca.issue("mismatch", [ADDRESS], key_of=other)
    [line] = tls_lines(check(pair(issued)))
    assert f"epd_tls_key {issued.key}: the key is not the key of the certificate in {issued.certificate}" in line
    assert "PRIVATE KEY" not in line and issued.key.read_text().splitlines()[1] not in line


@pytest.mark.parametrize("balancer", [False, True])
def test_names_that_do_not_cover_the_front_door_are_refused(ca, balancer):
    issued = ca.issue("elsewhere", ["10.9.9.9", "other.example.com"])
    [line] = tls_lines(check(pair(issued), balancer=balancer))
    assert f"its names (10.9.9.9, other.example.com) do not cover {ADDRESS}" in line
    assert "IP SAN" in line and "epd_tls_names" in line


def test_epd_tls_names_are_what_the_certificate_must_cover(ca):
    issued = ca.issue("named", ["*.example.com"])
    assert tls_lines(check({**pair(issued), "epd_tls_names": ["api.example.com"]})) == []
    [line] = tls_lines(check({**pair(issued), "epd_tls_names": ["a.b.example.com", "example.com"]}))
    assert "do not cover a.b.example.com, example.com" in line  # one label per '*', the bare name is not covered
    # an address is checked against IP SANs only, never a DNS SAN that spells it
    text = ca.issue("text", [ADDRESS.replace(".", "-") + ".example.com"])
    assert "do not cover" in tls_lines(check(pair(text)))[0]


def reordered(issued, tmp_path: Path, order: list[int], extra: bytes = b"") -> dict[str, str]:
    """The pair with its chain file's certificates in `order` (indexes into leaf, CA), then `extra`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certs = x509.load_pem_x509_certificates(issued.certificate.read_bytes())
    path = tmp_path / "chain.crt"
    path.write_bytes(b"".join(certs[i].public_bytes(serialization.Encoding.PEM) for i in order) + extra)
    return {"epd_tls_certificate": str(path), "epd_tls_key": str(issued.key)}


def test_a_chain_out_of_order_is_named_as_such_not_blamed_on_the_key_or_the_names(ca, tmp_path):
    issued = ca.issue("reversed", [ADDRESS])
    [line] = tls_lines(check(reordered(issued, tmp_path, [1, 0])))  # the CA first, then the leaf
    assert "the certificates are out of order: the key's own certificate (CN=10.213.0.13) is number 2 of 2" in line
    assert "put the leaf first, then each certificate's issuer after it" in line


def test_a_chain_whose_next_certificate_did_not_issue_the_leaf_is_refused(ca, tmp_path_factory, tmp_path):
    other = SandboxCa(tmp_path_factory.mktemp("other-ca"), name="another CA")
    issued = ca.issue("wrong-issuer", [ADDRESS])
    [line] = tls_lines(check(reordered(issued, tmp_path, [0], other.path.read_bytes())))
    assert (
        "certificate 2 (CN=another CA) did not issue certificate 1 (CN=10.213.0.13, issued by CN=epd-kit sandbox"
        in line
    )


@pytest.mark.parametrize(
    ("name", "host"),
    [("https://api.example.com:8443/v1", "api.example.com"), ("api.example.com:443", "api.example.com")],
)
def test_a_name_that_is_a_url_is_refused_as_a_name_not_blamed_on_the_certificate(ca, name, host):
    issued = ca.issue("url-name", [host])
    [line] = tls_lines(check({**pair(issued), "epd_tls_names": [name]}))
    assert line == (
        f"epd_tls_names[0] is {name!r}: write the host name or address clients use, alone ({host}): "
        "no scheme, port or path"
    )


def test_a_front_door_on_every_address_needs_epd_tls_names(ca):
    issued = ca.issue("wild", [ADDRESS])
    [line] = tls_lines(check(pair(issued), address="0.0.0.0"))
    assert "listens on every address (epd_router_listen_host 0.0.0.0)" in line and "set epd_tls_names" in line


def test_an_unreadable_file_or_a_key_others_may_read_is_refused(ca, tmp_path):
    issued = ca.issue("modes", [ADDRESS])
    [line] = tls_lines(check({**pair(issued), "epd_tls_key": str(tmp_path / "missing.key")}))
    assert f"cannot read {tmp_path / 'missing.key'} on the controller" in line
    issued.key.chmod(0o644)
    [line] = tls_lines(check(pair(issued)))
    assert f"epd_tls_key {issued.key}: the key file's mode is 0644" in line and f"chmod 0600 {issued.key}" in line
    issued.key.chmod(0o640)
    assert tls_lines(check(pair(issued))) == []


def test_half_a_pair_or_both_forms_are_refused(ca):
    issued = ca.issue("half", [ADDRESS])
    [line] = tls_lines(check({"epd_tls_certificate": str(issued.certificate)}))
    assert "epd_tls_certificate is set" in line and "epd_tls_key is not" in line
    [line] = tls_lines(check({**pair(issued), "epd_tls_bundle": str(issued.bundle)}))
    assert "both set" in line


def test_the_deploy_preflight_refuses_before_any_host_is_contacted(ca, tmp_path):
    """plan.yml (deploy's controller preflight runs the same entry point) on an inventory whose
    hosts do not exist: the bad certificate is refused, no host was contacted."""
    now = datetime.datetime.now(datetime.UTC)
    issued = ca.issue("expired-play", [ADDRESS], not_before=now - 30 * DAY, not_after=now - DAY)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  vars:\n    epd_model: /models/m\n    ansible_host: 192.0.2.1\n"
        f"    epd_tls_certificate: {issued.certificate}\n    epd_tls_key: {issued.key}\n"
        "  children:\n    epd_engines:\n      hosts:\n        n1:\n"
        f"          epd_num_ve: 1\n          epd_num_pd: 1\n          epd_bind_address: {ADDRESS}\n"
        "    epd_router:\n      hosts:\n        n1: {}\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "playbooks/plan.yml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(240),
        check=False,
    )
    out = " ".join(done.stdout.split())
    assert done.returncode != 0, out[-3000:]
    assert f"epd_tls_certificate {issued.certificate}: expired on" in out, out[-3000:]
    assert "UNREACHABLE" not in out and "PRIVATE KEY" not in out
