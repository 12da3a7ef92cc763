"""TLS of the router's own listener, for a fleet without HAProxy in front (docs/router.md "TLS").

One `ssl.SSLContext` per process, handed to uvicorn at start. A renewal re-reads the
certificate and key into that same context (SIGHUP, `systemctl reload epd-router`): handshakes
after it present the new certificate, open connections keep the session they negotiated. A new
pair is first loaded into a scratch context: OpenSSL's `SSL_CTX_use_certificate` drops a private
key that does not match the new certificate, so loading a bad pair straight into the live
context would leave it without a usable key. A bad pair keeps the old one and logs an error.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

log = logging.getLogger("epd_router.tls")

# Mozilla's "intermediate" server profile (ssl-config.mozilla.org, v5.7): TLS 1.2 with forward-
# secret AEAD suites only, TLS 1.3 (whose suites OpenSSL chooses itself); the same list the
# HAProxy role binds with (roles/epd_haproxy/templates/haproxy.cfg.j2).
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:"
    "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305:"
    "DHE-RSA-AES128-GCM-SHA256:DHE-RSA-AES256-GCM-SHA384:DHE-RSA-CHACHA20-POLY1305"
)


class ServerTls:
    """The listener's context and the files it was loaded from. `key` None: the key is in the
    certificate file (one PEM bundle)."""

    def __init__(self, certificate: Path, key: Path | None = None) -> None:
        self.certificate = certificate
        self.key = key
        self.context = _server_context()
        self.context.load_cert_chain(certificate, key)  # an error here stops the start (cli.py)

    def reload(self) -> bool:
        """Load the files again into the live context; a pair that does not load keeps the old one."""
        try:
            _server_context().load_cert_chain(self.certificate, self.key)
        except OSError as exc:  # ssl.SSLError is one
            log.error(
                "TLS certificate reload failed; new connections keep the running certificate",
                extra={"certificate": str(self.certificate), "key": str(self.key or ""), "error": str(exc)},
            )
            return False
        self.context.load_cert_chain(self.certificate, self.key)
        log.info("TLS certificate reloaded", extra={"certificate": str(self.certificate)})
        return True


def _server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(["http/1.1"])  # uvicorn speaks HTTP/1.1 only
    return context


def load_error(exc: Exception, certificate: Path, key: Path | None) -> str:
    """The start's message for a pair that does not load (never the key's content)."""
    where = f"listen.tls.certificate {certificate}" + (f", listen.tls.key {key}" if key else "")
    return f"cannot load the TLS certificate and key ({where}): {exc}"
