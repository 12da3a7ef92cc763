"""The front door's certificate, checked on the controller before any host changes.

The operator gives either `epd_tls_certificate` (a PEM chain, leaf first) and `epd_tls_key`, or
one PEM bundle `epd_tls_bundle` (chain and key, what HAProxy's `crt` reads). The front door is
HAProxy when the group epd_loadbalancer has hosts, else each router. Refused: a file that cannot
be read, a key others may read, an encrypted key (nothing could type its passphrase at a
reload), a certificate not yet or no longer valid, a key of another certificate, a certificate
whose subject alternative names do not cover every name clients use: `epd_tls_names` (DNS names
and addresses), or by default the front door's own listen addresses (an IP SAN each). Each
problem names the variable, the file, the value at fault (never key material) and the fix.

`cryptography` is ansible-core's own dependency, so it is on every controller; it is imported
here only, so the router's venv never needs it.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .net import WILDCARD_ADDRESSES

LOADBALANCER_GROUP, ROUTER_GROUP = "epd_loadbalancer", "epd_router"
TLS_VARIABLES = ("epd_tls_certificate", "epd_tls_key", "epd_tls_bundle", "epd_tls_names")


@dataclass(frozen=True)
class TlsFiles:
    """Where the pair is on the controller: `key` is None for a bundle (the key is in `certificate`)."""

    certificate: Path
    key: Path | None
    certificate_variable: str
    key_variable: str


def tls_files(fleet: Mapping[str, Any]) -> tuple[TlsFiles | None, list[str]]:
    """The files the inventory names (None: TLS is off), or the problems of naming them."""
    bundle, cert, key = (_text(fleet.get(n)) for n in ("epd_tls_bundle", "epd_tls_certificate", "epd_tls_key"))
    if bundle and (cert or key):
        return None, [
            f"epd_tls_bundle ({bundle}) and epd_tls_certificate/epd_tls_key are both set: give either the one "
            "PEM bundle or the certificate chain and its key"
        ]
    if bundle:
        return TlsFiles(Path(bundle), None, "epd_tls_bundle", "epd_tls_bundle"), []
    if bool(cert) != bool(key):
        given, missing = ("epd_tls_certificate", "epd_tls_key") if cert else ("epd_tls_key", "epd_tls_certificate")
        return None, [f"{given} is set ({cert or key}) but {missing} is not: TLS needs both (or one epd_tls_bundle)"]
    if not cert:
        return None, []
    return TlsFiles(Path(cert), Path(key), "epd_tls_certificate", "epd_tls_key"), []


def front_door_names(values: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The names and addresses clients reach the front door by, and the problems finding them."""
    fleet = _fleet(values, groups)
    names = fleet.get("epd_tls_names")
    if names:
        return [str(n) for n in names], []
    balancers = [str(h) for h in groups.get(LOADBALANCER_GROUP) or []]
    hosts = balancers or [str(h) for h in groups.get(ROUTER_GROUP) or []]
    variable = "epd_haproxy_bind_address" if balancers else "epd_router_listen_host"
    found, problems = [], []
    for host in hosts:
        own = values.get(host, {})
        address = str(own.get(variable) or own.get("epd_bind_address") or ("0.0.0.0" if balancers else "127.0.0.1"))
        if address in WILDCARD_ADDRESSES:
            problems.append(
                f"{host}: the front door listens on every address ({variable} {address}), so the certificate's "
                "names cannot be checked against it: set epd_tls_names to the DNS names or addresses clients use"
            )
        else:
            found.append(address)
    return list(dict.fromkeys(found)), problems


def tls_problems(values: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Any]) -> list[str]:
    """Every refusal of the front door's TLS settings; [] when TLS is off or all is well.
    `values`: each kit host's explicitly set variables (validate.explicit)."""
    files, problems = tls_files(_fleet(values, groups))
    if files is None:
        return problems
    names, problems = front_door_names(values, groups)
    bad_names = name_problems(names)
    if bad_names:  # the certificate is not at fault for them: check it against the names that are names
        problems += bad_names
        names = [n for n in names if not name_problems([n])]
    try:
        chain_pem = files.certificate.read_bytes()
        key_pem = chain_pem if files.key is None else files.key.read_bytes()
    except OSError as exc:
        path = exc.filename or files.certificate
        return [
            f"{files.certificate_variable}/{files.key_variable}: cannot read {path} on the controller "
            f"({exc.strerror}): give a readable path"
        ]
    key_path = files.key or files.certificate
    mode = stat.S_IMODE(key_path.stat().st_mode)
    if mode & 0o037:  # group write/exec or anything for others: 0600, 0640, 0400, 0440 pass
        problems.append(
            f"{files.key_variable} {key_path}: the key file's mode is {mode:04o}, others may read or change it: "
            f"chmod 0600 {key_path}"
        )
    return problems + _pair_problems(files, chain_pem, key_pem, names)


def _pair_problems(files: TlsFiles, chain_pem: bytes, key_pem: bytes, names: list[str]) -> list[str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    where = f"{files.certificate_variable} {files.certificate}"
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
    except ValueError:
        return [f"{where}: no PEM certificate in the file: give the certificate chain, leaf first"]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        return [
            f"{files.key_variable} {files.key or files.certificate}: the key is encrypted: give it without "
            "a passphrase (HAProxy and the router read it at every reload), e.g. openssl pkey -in KEY -out KEY.new"
        ]
    except ValueError:
        return [f"{files.key_variable} {files.key or files.certificate}: no PEM private key in the file"]
    problems, leaf = _order_problems(where, chain, key)
    now = datetime.datetime.now(datetime.UTC)
    if now < leaf.not_valid_before_utc:
        problems.append(
            f"{where}: not valid before {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (now {now:%Y-%m-%d %H:%M}): "
            "check the controller's clock or give a certificate valid now"
        )
    if now >= leaf.not_valid_after_utc:
        problems.append(
            f"{where}: expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it "
            '(docs/operations.md "Renewing the certificate")'
        )
    if not _owns(key, leaf):
        problems.append(
            f"{files.key_variable} {files.key or files.certificate}: the key is not the key of the "
            f"certificate in {files.certificate} (serial {leaf.serial_number:x}): give the pair's own key"
        )
    uncovered = [name for name in names if not covers(leaf, name)]
    if uncovered:
        problems.append(
            f"{where}: its names ({', '.join(san_names(leaf)) or 'none'}) do not cover "
            f"{', '.join(uncovered)}, where clients reach the front door: issue it with these as "
            "subject alternative names (an IP SAN for an address, a DNS SAN for a name), or set "
            "epd_tls_names to the names clients use"
        )
    return problems


def _owns(key: Any, cert: Any) -> bool:
    from cryptography.hazmat.primitives import serialization

    public = (serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(key.public_key().public_bytes(*public) == cert.public_key().public_bytes(*public))


def _signs(issuer: Any, cert: Any) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)  # the issuer's name and its signature over cert
    except Exception:  # ValueError, TypeError, InvalidSignature: not this one's issuer
        return False
    return True


def _order_problems(where: str, chain: list[Any], key: Any) -> tuple[list[str], Any]:
    """The chain's order, leaf first and each certificate's issuer after it (what HAProxy and
    the router send as is), judged by which certificate the key belongs to and which signs which.
    Returns the problems and the leaf: the key's own certificate where it has one, so the dates
    and names are checked on it and not blamed on a CA certificate that came first."""
    owner = next((i for i, cert in enumerate(chain) if _owns(key, cert)), None)
    if owner is None:  # the key belongs to none of them: the key check names that
        return [], chain[0]
    leaf = chain[owner]
    if owner:
        return [
            f"{where}: the certificates are out of order: the key's own certificate ({_subject(leaf)}) is "
            f"number {owner + 1} of {len(chain)}, after {_subject(chain[0])}: put the leaf first, then each "
            "certificate's issuer after it (cat leaf.crt intermediate.crt > chain.crt)"
        ], leaf
    for number, (cert, issuer) in enumerate(itertools.pairwise(chain), start=1):
        if not _signs(issuer, cert):
            return [
                f"{where}: certificate {number + 1} ({_subject(issuer)}) did not issue certificate {number} "
                f"({_subject(cert)}, issued by {cert.issuer.rfc4514_string()}): after the leaf put its issuer, "
                "then that one's issuer"
            ], leaf
    return [], leaf


def _subject(cert: Any) -> str:
    return cert.subject.rfc4514_string() or f"serial {cert.serial_number:x}"


# a DNS name as a certificate carries it (RFC 1123 labels, an optional leading *.): no scheme, port or path
DNS_NAME = re.compile(
    r"^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?$"
)


def name_problems(names: list[str]) -> list[str]:
    """epd_tls_names entries that are neither an address nor a host name (a URL, a host:port)."""
    problems = []
    for index, name in enumerate(names):
        try:
            ipaddress.ip_address(name)
            continue
        except ValueError:
            pass
        if DNS_NAME.fullmatch(name):
            continue
        host = urlsplit(name if "//" in name else f"//{name}").hostname or ""
        problems.append(
            f"epd_tls_names[{index}] is {name!r}: write the host name or address clients use, alone "
            f"({host or 'e.g. api.example.com'}): no scheme, port or path"
        )
    return problems


def san_names(cert: Any) -> list[str]:
    from cryptography import x509

    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in sans.get_values_for_type(x509.IPAddress)] + sans.get_values_for_type(x509.DNSName)


def covers(cert: Any, name: str) -> bool:
    """RFC 6125 as clients check it: an address against IP SANs only; a name against DNS SANs,
    `*.` matching one whole left-most label (the common name is not looked at)."""
    from cryptography import x509

    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        name = name.lower().rstrip(".")
        for pattern in (p.lower().rstrip(".") for p in sans.get_values_for_type(x509.DNSName)):
            if pattern == name:
                return True
            if pattern.startswith("*.") and "." in name and name.split(".", 1)[1] == pattern[2:]:
                return True
        return False
    return address in sans.get_values_for_type(x509.IPAddress)


def _fleet(values: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Any]) -> dict[str, Any]:
    """The fleet's TLS settings: the first front-door host that sets them (fleet values agree,
    validate.scope_problems checks it)."""
    order = [str(h) for group in (LOADBALANCER_GROUP, ROUTER_GROUP) for h in groups.get(group) or []]
    for host in [*order, *values]:
        own = values.get(host, {})
        if any(own.get(n) not in (None, "", []) for n in TLS_VARIABLES):
            return {n: own.get(n) for n in TLS_VARIABLES}
    return {}


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()
