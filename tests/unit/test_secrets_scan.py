"""The secret grep of the sandbox deploy (tests/e2e/secrets_scan.py) finds planted leaks: its
host-side scan run here over a planted tree, and the rule that sorts the hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.secrets_scan import SCAN, Hit, hits_of, leaks, scan_request, text_hits

SECRETS = {"engine key": "ek-5d1c0ffee9a7", "admin token": "at-77b3beef0c21"}
KIT_GID = 4242


def scan(root, **kw) -> list[Hit]:
    request = scan_request(SECRETS, [str(root)], journal=False, proc=kw.get("proc", False))
    out = subprocess.run([sys.executable, "-c", SCAN], input=request, capture_output=True, text=True, check=True)
    return hits_of(json.loads(out.stdout))


def test_a_secret_in_a_readable_file_is_a_leak_and_in_a_0600_or_0640_file_is_not(tmp_path):
    planted = {
        "engine-key": ("ek-5d1c0ffee9a7\n", 0o640),
        "router.env": ("X=at-77b3beef0c21\n", 0o600),
        "unit.service": ("ExecStart=/bin/vllm --api-key ek-5d1c0ffee9a7\n", 0o644),
        "log/router.log": ("token at-77b3beef0c21\n", 0o660),
        "clean.yaml": ("engine_auth: {key_file: /etc/epd/engine-key}\n", 0o644),
    }
    for name, (text, mode) in planted.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
    hits = scan(tmp_path)
    assert sorted((os.path.basename(h.where), h.secret) for h in hits) == [
        ("engine-key", "engine key"),
        ("router.env", "admin token"),
        ("router.log", "admin token"),
        ("unit.service", "engine key"),
    ]
    # the test runs as root here (the files are root:root): the 0600/0640 ones are allowed
    found = leaks(hits, KIT_GID)
    assert len(found) == 2, found
    assert any("unit.service (mode 0644" in leak for leak in found)
    assert any("router.log (mode 0660" in leak for leak in found)
    assert all(value not in " ".join(found) for value in SECRETS.values())  # names, never values


def test_the_owner_and_group_decide_too():
    key = Hit("/etc/epd/engine-key", "engine key", 0o100640, 0, KIT_GID)
    assert leaks([key], KIT_GID) == []
    assert leaks([Hit(key.where, key.secret, 0o100640, 0, 1000)], KIT_GID)  # another group reads it
    assert leaks([Hit(key.where, key.secret, 0o100640, 999, KIT_GID)], KIT_GID)  # not root's


def test_journals_argv_and_controller_text_never_hold_a_secret():
    assert leaks([Hit("journal", "engine key")], KIT_GID) == ["engine key in journal"]
    output = "TASK [Write the engines' key] ok: [n1] => ek-5d1c0ffee9a7"
    assert [h.secret for h in text_hits("ansible-playbook output", output, SECRETS)] == ["engine key"]
    assert text_hits("a 400 body", '{"error":{"message":"invalid"}}', SECRETS) == []


def test_argv_is_scanned(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ek-5d1c0ffee9a7"])
    try:
        hits = scan(tmp_path, proc=True)
    finally:
        process.kill()
        process.wait()
    assert any(h.where.endswith("/cmdline") and h.secret == "engine key" for h in hits), hits
