#!/usr/bin/python
"""epd_host_versions: what a host runs of the Neuron, EFA, libfabric, NIXL, vLLM and kit stack."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_host_versions
short_description: Report the installed Neuron driver, runtime, EFA, libfabric, NIXL, vLLM and kit versions
description:
  - Reads the dpkg database for the Neuron system packages and libfabric, the EFA installer's
    record C(/opt/amazon/efa_installed_packages), the loaded Neuron driver's
    C(/sys/module/neuron/version), and the Python distributions of the engine venv and the kit venv.
  - What is not installed is reported as null.
  - With O(expected), also lists every component whose installed version differs from its pin (drift).
    A pin matches an installed Debian version when it equals the version or its upstream part
    (C(2.24.7.0) matches C(2.24.7.0-dcd0b2d2d)), and a Python version without its local label
    (C(0.6.0) matches C(0.6.0+standin), as pip's C(==) does). Each drift entry says whether the
    installed version is newer than the pin (a host that must not be downgraded).
  - Read-only; supports check mode. Also sets the fact C(epd_host_versions).
options:
  engine_python:
    description: Interpreter of the engine venv (vllm, vllm-neuron, NIXL); absent = those are null.
    type: path
  kit_python:
    description: Interpreter of the kit venv (epd-kit); absent = null.
    type: path
  engine_distributions:
    description:
      - Python distributions to read in the engine venv; each one's component is its name with C(_) for C(-)
        (C(vllm-neuron) -> C(vllm_neuron)). The default is the kit's engine venv set of any supported release.
    type: list
    elements: str
    default: [nixl, vllm, vllm-neuron, neuronx-cc, libtorch-neuronx-lite, torch-neuronx, nki]
  expected:
    description:
      - Pins, keyed like RV(versions) (e.g. C(driver) = C(2.24.7.0), C(nixl) = C(1.5.1)).
      - Empty values are not compared.
    type: dict
    default: {}
  dpkg_status:
    description: The dpkg status file (tests point it at a file of their own).
    type: path
    default: /var/lib/dpkg/status
  efa_record:
    description: The EFA installer's record of what it installed.
    type: path
    default: /opt/amazon/efa_installed_packages
author: epd-kit
"""

EXAMPLES = r"""
- name: Read the installed versions and the drift from the pins
  epd.kit.epd_host_versions:
    engine_python: /opt/epd/engine-venv/bin/python
    kit_python: /opt/epd/venv/bin/python
    expected: {driver: 2.24.7.0, runtime: 2.28.23.0, efa_installer: 1.41.0, nixl: 1.5.1}
  register: epd_versions
"""

RETURN = r"""
versions:
  description: Installed version per component, null when absent.
  type: dict
  returned: always
  sample:
    driver: 2.24.7.0-dcd0b2d2d
    driver_loaded: 2.24.7.0
    runtime: 2.28.23.0-1
    collectives: 2.28.27.0-1
    tools: 2.26.14.0-1
    efa_installer: 1.41.0
    libfabric: 2.1.0amzn3.0-1
    nixl: 1.5.1
    vllm: 0.24.0
    vllm_neuron: null
    kit: 0.1.0
drift:
  description: Components whose installed version differs from O(expected).
  type: list
  elements: dict
  returned: always
  sample: [{component: nixl, expected: 1.5.1, installed: null, newer: false}]
"""

import json
import os
import re
import subprocess

from ansible.module_utils.basic import AnsibleModule

# component -> dpkg packages that provide it, first installed wins (EFA's libfabric before Debian's)
DEBIAN_COMPONENTS = {
    "driver": ("aws-neuronx-dkms",),
    "runtime": ("aws-neuronx-runtime-lib",),
    "collectives": ("aws-neuronx-collectives",),
    "tools": ("aws-neuronx-tools",),
    "libfabric": ("libfabric-aws-bin", "libfabric1-aws", "libfabric1"),
}
KIT_DISTRIBUTIONS = {"kit": "epd-kit"}
EFA_VERSION_LINE = re.compile(r"^#\s*EFA installer version:\s*(\S+)", re.MULTILINE)
DRIVER_VERSION_FILE = "/sys/module/neuron/version"

# Runs inside a venv's interpreter: prints {distribution: version or null} as JSON.
DISTRIBUTION_VERSIONS = r"""
import json, sys
from importlib import metadata
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def installed_debian_packages(status_text: str) -> dict[str, str]:
    """Package -> version of every package dpkg lists as installed."""
    packages: dict[str, str] = {}
    for stanza in status_text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields and "Version" in fields:
            packages[fields["Package"]] = fields["Version"]
    return packages


def efa_installer_version(record_text: str | None) -> str | None:
    match = EFA_VERSION_LINE.search(record_text or "")
    return match.group(1) if match else None


def distribution_versions(python: str | None, names: list[str]) -> dict[str, str | None]:
    absent = dict.fromkeys(names)
    if not python or not os.access(python, os.X_OK):
        return absent
    result = subprocess.run(
        [python, "-c", DISTRIBUTION_VERSIONS, *names], capture_output=True, text=True, timeout=60, check=False
    )
    return json.loads(result.stdout) if result.returncode == 0 else absent


def component(distribution: str) -> str:
    """A distribution's component name: vllm-neuron -> vllm_neuron."""
    return distribution.replace("-", "_")


def upstream(installed: str) -> str:
    """A Debian version without epoch and revision (1:2.24.7.0-1 -> 2.24.7.0)."""
    return installed.split(":", 1)[-1].rsplit("-", 1)[0]


def matches(pin: str, installed: str | None) -> bool:
    """A pin matches the installed version itself, a Debian version's upstream part, or a
    Python version without its local label when the pin has none."""
    if installed is None:
        return False
    candidates = {installed, upstream(installed)}
    if "+" not in pin:
        candidates.add(installed.split("+", 1)[0])
    return pin in candidates


def version_key(version: str) -> tuple:
    """Numbers compare as numbers, words as words (2.30.10.0 > 2.30.9.0; 2.30.2.0 > 2.30.2.0rc1 is not needed)."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.findall(r"\d+|[a-z]+", version.lower())
    )


def newer(installed: str | None, pin: str) -> bool:
    """Whether the installed version is above the pin (compared on the upstream part, no local label)."""
    if installed is None:
        return False
    return version_key(upstream(installed).split("+", 1)[0]) > version_key(pin.split("+", 1)[0])


def drift(versions: dict[str, str | None], expected: dict[str, str]) -> list[dict]:
    return [
        {
            "component": component,
            "expected": str(pin),
            "installed": versions.get(component),
            "newer": newer(versions.get(component), str(pin)),
        }
        for component, pin in expected.items()
        if pin not in (None, "") and not matches(str(pin), versions.get(component))
    ]


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def host_versions(params: dict) -> dict[str, str | None]:
    packages = installed_debian_packages(read_text(params["dpkg_status"]) or "")
    versions: dict[str, str | None] = {
        component: next((packages[p] for p in candidates if p in packages), None)
        for component, candidates in DEBIAN_COMPONENTS.items()
    }
    loaded = read_text(DRIVER_VERSION_FILE)
    versions["driver_loaded"] = loaded.strip() if loaded else None
    versions["efa_installer"] = efa_installer_version(read_text(params["efa_record"]))
    names = list(params["engine_distributions"])
    engine = distribution_versions(params.get("engine_python"), names)
    versions.update({component(dist): engine.get(dist) for dist in names})
    kit = distribution_versions(params.get("kit_python"), list(KIT_DISTRIBUTIONS.values()))
    versions.update({component: kit[dist] for component, dist in KIT_DISTRIBUTIONS.items()})
    return versions


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "engine_python": {"type": "path"},
            "kit_python": {"type": "path"},
            "engine_distributions": {
                "type": "list",
                "elements": "str",
                "default": [
                    "nixl",
                    "vllm",
                    "vllm-neuron",
                    "neuronx-cc",
                    "libtorch-neuronx-lite",
                    "torch-neuronx",
                    "nki",
                ],
            },
            "expected": {"type": "dict", "default": {}},
            "dpkg_status": {"type": "path", "default": "/var/lib/dpkg/status"},
            "efa_record": {"type": "path", "default": "/opt/amazon/efa_installed_packages"},
        },
        supports_check_mode=True,
    )
    versions = host_versions(module.params)
    module.exit_json(
        changed=False,
        versions=versions,
        drift=drift(versions, module.params["expected"]),
        ansible_facts={"epd_host_versions": versions},
    )


if __name__ == "__main__":
    main()
