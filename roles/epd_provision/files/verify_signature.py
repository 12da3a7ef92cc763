#!/usr/bin/env python3
"""Check a detached OpenPGP signature with gpgv against one armored public key.

    verify_signature.py KEY.asc FILE.sig FILE

The EFA installer is signed with aws-efa-installer.key (setup/pytorch/manual.rst:
`gpg --import aws-efa-installer.key`, `gpg --verify ...tar.gz.sig`). Hosts have gpgv (apt
depends on it) but not always gpg, and gpgv reads only binary keyrings: the armored key is
turned into one here (RFC 4880 section 6.2: the base64 body between the armor lines, without
its CRC line). Prints one JSON line: {"valid": bool, "fingerprint": primary key fingerprint or
"", "error": gpgv's message or ""}. Exit 0 either way; the caller judges.
"""

from __future__ import annotations

import base64
import binascii
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def dearmor(text: str) -> bytes:
    lines = text.strip().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN PGP PUBLIC KEY BLOCK"))
        end = next(i for i, line in enumerate(lines) if line.startswith("-----END PGP PUBLIC KEY BLOCK"))
    except StopIteration:
        raise ValueError("not an armored OpenPGP public key") from None
    body = lines[start + 1 : end]
    blank = next((i for i, line in enumerate(body) if not line.strip()), None)
    if blank is not None:  # armor headers end at the first blank line
        body = body[blank + 1 :]
    data = "".join(line.strip() for line in body if not line.startswith("="))
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise ValueError(f"the key's armor is not base64 ({error})") from None


def verify(key: Path, signature: Path, data: Path) -> dict:
    try:
        keyring_bytes = dearmor(key.read_text(encoding="ascii", errors="replace"))
    except (OSError, ValueError) as error:
        return {"valid": False, "fingerprint": "", "error": f"{key}: {error}"}
    with tempfile.TemporaryDirectory(prefix="epd-gpgv-") as tmp:
        keyring = Path(tmp) / "keyring.gpg"
        keyring.write_bytes(keyring_bytes)
        argv = ["gpgv", "--status-fd", "1", "--keyring", str(keyring), str(signature), str(data)]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        except FileNotFoundError:
            return {"valid": False, "fingerprint": "", "error": "gpgv is not installed (Debian/Ubuntu package gpgv)"}
    status = [line.split() for line in result.stdout.splitlines() if line.startswith("[GNUPG:] ")]
    valid = [fields for fields in status if fields[1] == "VALIDSIG"]
    if result.returncode == 0 and valid:
        return {"valid": True, "fingerprint": valid[0][-1], "error": ""}
    reason = " ".join(line for line in result.stderr.splitlines() if line.startswith("gpgv:"))[-400:]
    return {"valid": False, "fingerprint": "", "error": reason or f"gpgv exited {result.returncode}"}


def main() -> int:
    if len(sys.argv) != 4:
        sys.stderr.write(__doc__)
        return 2
    print(json.dumps(verify(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
