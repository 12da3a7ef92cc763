"""The secret grep of a sandbox deploy (issue 37 item 5, docs/security.md "Secrets"): every
secret's value is looked for in each host's journal (every field of every entry, all units),
its files under /etc/epd, /etc/systemd/system, /run/epd*, /var/log and /etc/haproxy, the argv of
its processes (/proc/*/cmdline), and in what the controller saw (the deploy's Ansible output,
the router's error bodies). A secret may only be in a file that is root-owned, of group root or
the kit's group, and that group at most reads (0600/0640); anywhere else is a leak.

`SCAN` runs on a host (python3 -c, the secrets on its stdin, never in an argv) and prints its
hits as JSON; `leaks` sorts them. tests/unit/test_secrets_scan.py plants leaks to show it finds them.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SCAN_ROOTS = ("/etc/epd", "/etc/systemd/system", "/run/epd*", "/var/log", "/etc/haproxy")

# the host side: stdin {"secrets": {name: value}, "roots": [globs], "journal": bool, "proc": bool}
SCAN = r"""
import glob, json, os, subprocess, sys
req = json.load(sys.stdin)
secrets = {k: v.encode() for k, v in req["secrets"].items()}
hits = []
def look(where, data, st=None):
    for name, value in secrets.items():
        if value in data:
            hits.append({"where": where, "secret": name, "mode": None if st is None else st.st_mode,
                         "uid": None if st is None else st.st_uid, "gid": None if st is None else st.st_gid})
for root in req["roots"]:
    for top in glob.glob(root):
        for base, dirs, files in os.walk(top):
            for f in files:
                path = os.path.join(base, f)
                try:
                    st = os.lstat(path)
                    if not os.path.isfile(path) or os.path.islink(path) or st.st_size > 256 * 1024 * 1024:
                        continue
                    with open(path, "rb") as fh:
                        look(path, fh.read(), st)
                except OSError:
                    pass
if req["journal"]:
    out = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "json"], capture_output=True).stdout
    look("journal", out)
if req["proc"]:
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as fh:
                look(cmdline.replace("\0", " "), fh.read().replace(b"\0", b" "))
        except OSError:
            pass
json.dump(hits, sys.stdout)
"""


@dataclass(frozen=True)
class Hit:
    where: str  # a file's path, "journal", "/proc/N/cmdline", or what the controller read
    secret: str  # the secret's name (never its value)
    mode: int | None = None  # a file's st_mode; None for anything that is not a file
    uid: int | None = None
    gid: int | None = None

    def describe(self) -> str:
        if self.mode is None:
            return f"{self.secret} in {self.where}"
        return f"{self.secret} in {self.where} (mode {stat.S_IMODE(self.mode):04o}, uid {self.uid}, gid {self.gid})"


def hits_of(raw: Iterable[Mapping]) -> list[Hit]:
    return [Hit(**entry) for entry in raw]


def text_hits(where: str, text: str, secrets: Mapping[str, str]) -> list[Hit]:
    """The secrets found in something the controller holds (Ansible output, an answer body)."""
    return [Hit(where, name) for name, value in secrets.items() if value and value in text]


def allowed(hit: Hit, kit_gid: int) -> bool:
    """A file root owns, of group root or the kit's, that no one but root and its group reads
    (0600 or 0640: no group write or execute, nothing for others)."""
    if hit.mode is None:
        return False
    return stat.S_ISREG(hit.mode) and hit.uid == 0 and hit.gid in (0, kit_gid) and stat.S_IMODE(hit.mode) & 0o137 == 0


def leaks(hits: Iterable[Hit], kit_gid: int) -> list[str]:
    return [hit.describe() for hit in hits if not allowed(hit, kit_gid)]


def scan_request(
    secrets: Mapping[str, str], roots: Iterable[str] = SCAN_ROOTS, *, journal: bool = True, proc: bool = True
) -> str:
    return json.dumps({"secrets": dict(secrets), "roots": list(roots), "journal": journal, "proc": proc})


# --- on a deployed stack ------------------------------------------------------------------------

# on a host: the engine key and admin token as the router host holds them, and a line of the body
# of every private key under the TLS directories (HAProxy's and the router's PEM files)
COLLECT = r"""
import glob, json, sys
found = {}
for name, path in (("engine key", "/etc/epd/engine-key"), ("admin token", "/etc/epd/admin-token")):
    try:
        for i, line in enumerate(open(path).read().split()):
            found[f"{name} {i + 1}"] = line
    except OSError:
        pass
for path in glob.glob("/etc/epd/**/*.pem", recursive=True) + glob.glob("/etc/haproxy/**/*.pem", recursive=True):
    lines = open(path).read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("-----BEGIN") and "PRIVATE KEY" in line and i + 2 < len(lines):
            found[f"TLS key of {path}"] = lines[i + 2]  # a full 64-character line of the key
try:
    import yaml
    keys_file = (yaml.safe_load(open("/etc/epd/router.yaml")) or {}).get("auth", {}).get("api_keys_file")
except Exception:
    keys_file = None
if keys_file:
    for i, line in enumerate(l for l in open(keys_file).read().split() if not l.startswith("#")):
        found[f"API key {i + 1}"] = line
json.dump(found, sys.stdout)
"""


def python_on(host, script: str, stdin: str = "", *args: str) -> str:
    """python3 inside the host, `stdin` on its standard input (never in an argv)."""
    from tests.hosts.harness import run

    argv = ["nsenter", "-t", str(host.leader_pid()), "-a", "/usr/bin/python3", "-c", script, *args]
    return run(argv, input=stdin, timeout=300).stdout


def stack_secrets(stack) -> dict[str, str]:
    found: dict[str, str] = {}
    for host in stack.hosts.values():
        for what, value in json.loads(python_on(host, COLLECT)).items():
            found.setdefault(what, value)
    return found


def scan_stack(stack, secrets: Mapping[str, str], bodies: Mapping[str, str]) -> tuple[list[str], set[tuple[str, str]]]:
    """Every leak of `secrets` on the stack's hosts, in its deploy's output and in `bodies`
    (what the router and engines answered, by what was asked); and the (host, file) pairs where
    a secret was found and is allowed (which shows the scan read the hosts' files)."""
    found: list[str] = []
    allowed_files: set[tuple[str, str]] = set()
    for name, host in stack.hosts.items():
        gid = int(host.run("getent group epd | cut -d: -f3").stdout.strip() or -1)
        hits = hits_of(json.loads(python_on(host, SCAN, scan_request(secrets))))
        found += [f"{name}: {leak}" for leak in leaks(hits, gid)]
        allowed_files |= {(name, hit.where) for hit in hits if allowed(hit, gid)}
    found += [h.describe() for h in text_hits("the deploy's ansible-playbook output", stack.deploy_output, secrets)]
    for asked, body in bodies.items():
        found += [h.describe() for h in text_hits(f"the answer to {asked}", body, secrets)]
    return found, allowed_files


# on the router host: a PD's /inference without and with the engine key (read there, never an argv)
ENGINE_PROBE = r"""
import json, sys, urllib.error, urllib.request
key = open("/etc/epd/engine-key").read().split()[0]
out = {}
for name, extra in (("without the key", {}), ("with the key", {"Authorization": "Bearer " + key})):
    headers = {"content-type": "application/json", **extra}
    request = urllib.request.Request(sys.argv[1] + "/inference/v1/generate", data=b"{}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            out[name] = [answer.status, answer.read().decode()]
    except urllib.error.HTTPError as error:
        out[name] = [error.code, error.read().decode()]
json.dump(out, sys.stdout)
"""
