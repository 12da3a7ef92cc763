#!/usr/bin/python
"""epd_neuron_facts: find faulted Neuron devices from the driver's reset-failure counters."""

DOCUMENTATION = r"""
---
module: epd_neuron_facts
short_description: Report faulted Neuron devices and the NeuronCores to exclude
description:
  - Reads C(<root>/neuron<d>/neuron_core<c>/stats/other_info/reset_fail_count/total) for every
    Neuron device the driver exposes. A device whose cores report a nonzero reset-failure
    count is in the faulted state (the tutorial's C(tdrv_init_wait_ncs_ready ... timeout)
    case); every core of such a device is reported for exclusion.
  - An absent tree means no device is known to be faulted (no Neuron driver, a test host).
  - Read-only; supports check mode. Also sets the fact C(epd_neuron).
options:
  root:
    description: The Neuron driver's sysfs directory (tests point it at a fake tree).
    type: path
    default: /sys/devices/virtual/neuron_device
  cores_per_device:
    description:
      - NeuronCores per device as numbered in NEURON_VISIBLE_DEVICES
        (trn2 with the default logical core size has 4).
    type: int
    default: 4
"""

EXAMPLES = r"""
- name: Find faulted Neuron devices
  epd.kit.epd_neuron_facts:
  register: epd_neuron_scan

- name: Preview a fake tree
  epd.kit.epd_neuron_facts:
    root: /tmp/fake-sysfs/neuron_device
"""

RETURN = r"""
sysfs_present:
  description: Whether the driver's tree exists.
  type: bool
  returned: always
device_count:
  description: Neuron devices found (C(neuron<d>) directories).
  type: int
  returned: always
cores_per_device:
  description: The cores_per_device used for numbering.
  type: int
  returned: always
core_count:
  description: device_count x cores_per_device.
  type: int
  returned: always
faulted_devices:
  description: Device indexes with a nonzero reset-failure count on any core.
  type: list
  elements: int
  returned: always
faulted_cores:
  description: Every core of every faulted device (device x cores_per_device + c).
  type: list
  elements: int
  returned: always
reset_fail_counts:
  description: Per faulted device, the reset-failure count of each core read (C(nd5) -> C({nc0 3, ...})).
  type: dict
  returned: always
unreadable:
  description: Counter files that exist but could not be parsed (reported, not treated as faulted).
  type: list
  elements: str
  returned: always
"""

import os
import re

DEFAULT_ROOT = "/sys/devices/virtual/neuron_device"
COUNTER = os.path.join("stats", "other_info", "reset_fail_count", "total")


def _indexed(directory, prefix):
    """Sorted (index, path) of entries named <prefix><digits>."""
    found = []
    for name in os.listdir(directory):
        match = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def scan_neuron_devices(root=DEFAULT_ROOT, cores_per_device=4):
    """The faulted devices and the cores to exclude; pure read of the sysfs tree."""
    if not isinstance(cores_per_device, int) or isinstance(cores_per_device, bool) or cores_per_device < 1:
        raise ValueError(f"cores_per_device must be a positive integer, got {cores_per_device!r}")
    result = {
        "sysfs_present": os.path.isdir(root),
        "device_count": 0,
        "cores_per_device": cores_per_device,
        "core_count": 0,
        "faulted_devices": [],
        "faulted_cores": [],
        "reset_fail_counts": {},
        "unreadable": [],
    }
    if not result["sysfs_present"]:
        return result
    devices = _indexed(root, "neuron")
    result["device_count"] = len(devices)
    result["core_count"] = len(devices) * cores_per_device
    for device, device_path in devices:
        counts = {}
        for core, core_path in _indexed(device_path, "neuron_core") if os.path.isdir(device_path) else []:
            counter = os.path.join(core_path, COUNTER)
            if not os.path.exists(counter):
                continue
            try:
                with open(counter) as handle:
                    counts[f"nc{core}"] = int(handle.read().strip())
            except (OSError, ValueError):
                result["unreadable"].append(counter)
        if any(value > 0 for value in counts.values()):
            result["faulted_devices"].append(device)
            result["faulted_cores"].extend(range(device * cores_per_device, (device + 1) * cores_per_device))
            result["reset_fail_counts"][f"nd{device}"] = counts
    return result


def main():
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "root": {"type": "path", "default": DEFAULT_ROOT},
            "cores_per_device": {"type": "int", "default": 4},
        },
        supports_check_mode=True,
    )
    if module.params["cores_per_device"] < 1:
        module.fail_json(msg="cores_per_device must be >= 1 (trn2: 4)")
    try:
        facts = scan_neuron_devices(module.params["root"], module.params["cores_per_device"])
    except OSError as error:
        module.fail_json(msg="cannot read the Neuron driver tree {}: {}".format(module.params["root"], error))
    for path in facts["unreadable"]:
        module.warn(f"cannot parse {path}")
    if facts["faulted_devices"]:
        devices = ", ".join(map(str, facts["faulted_devices"]))
        cores = ", ".join(map(str, facts["faulted_cores"]))
        module.warn(
            f"Neuron device(s) {devices} are in a faulted state (nonzero reset_fail_count); their cores {cores} "
            "are excluded. Restarting will not clear it: reset the device or replace the instance."
        )
    module.exit_json(changed=False, ansible_facts={"epd_neuron": facts}, **facts)


if __name__ == "__main__":
    main()
