"""A sandbox certificate authority and front-door certificates, made at test time (never committed).

`SandboxCa(directory).issue(...)` writes a PEM chain and key signed by the CA; clients verify
with `ca.path`. The variants preflight must refuse (expired, not yet valid, names it does not
cover, a key of another pair) come from the same call's arguments.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Issued:
    certificate: Path  # the leaf, then the CA (a chain as an operator would give it)
    key: Path
    bundle: Path  # chain and key in one file (HAProxy's `crt`)
    serial: int


class SandboxCa:
    def __init__(self, directory: Path, name: str = "epd-kit sandbox CA") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - DAY)
            .not_valid_after(_now() + 30 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.path = directory / "ca.pem"
        self.path.write_bytes(_pem(self._cert))

    def issue(
        self,
        stem: str,
        names: list[str],
        *,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
        key_of: Issued | None = None,
    ) -> Issued:
        """A server certificate for `names` (IP addresses become IP SANs, the rest DNS SANs),
        valid from yesterday for 30 days unless told otherwise; `key_of` writes another pair's
        key beside it (a key that does not match)."""
        key = _key()
        sans = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else stem)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or _now() - DAY)
            .not_valid_after(not_after or _now() + 30 * DAY)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = _pem(cert) + _pem(self._cert)
        certificate = self.directory / f"{stem}.crt"
        certificate.write_bytes(chain)
        key_path = self.directory / f"{stem}.key"
        if key_of is None:
            _write_key(key, key_path)
        else:
            key_path.write_bytes(key_of.key.read_bytes())
            key_path.chmod(0o600)
        bundle = self.directory / f"{stem}.pem"
        bundle.write_bytes(chain + key_path.read_bytes())
        bundle.chmod(0o600)
        return Issued(certificate, key_path, bundle, cert.serial_number)


def trust(ca: SandboxCa | Path) -> ssl.SSLContext:
    """A client context that trusts the sandbox CA only (httpx's `verify=`, openai's http_client)."""
    return ssl.create_default_context(cafile=str(ca.path if isinstance(ca, SandboxCa) else ca))


def served_serial(host: str, port: int, ca: Path) -> int:
    """The serial number of the certificate a TLS server presents now (a new handshake)."""
    context = trust(ca)
    context.check_hostname = False  # the serial is asked, not the name (the clients check names)
    with socket.create_connection((host, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
