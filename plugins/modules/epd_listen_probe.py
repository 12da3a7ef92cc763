#!/usr/bin/python
"""Ansible module: which of the given TCP ports are already listened on, and by whom."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_listen_probe
short_description: Find TCP listeners on the ports an EPD host is about to use
description:
  - Reads /proc/net/tcp and /proc/net/tcp6 for sockets in LISTEN state on the given ports and
    maps each to its process through /proc/PID/fd.
  - Listeners that belong to the kit's own units (epd-engine@*.service, epd-router@*.service,
    found through /proc/PID/cgroup, and the router's listener epd-router.socket, which systemd
    itself holds) are reported separately, as they are replaced by the deploy.
  - Read-only; supports check mode.
options:
  ports:
    description: TCP ports to probe.
    type: list
    elements: int
    required: true
author: epd-kit
"""

EXAMPLES = r"""
- name: Probe the ports this host is about to use
  epd.kit.epd_listen_probe:
    ports: [18100, 18101, 18300, 18800]
  register: listeners
"""

RETURN = r"""
conflicts:
  description: Listeners on the ports that belong to something else than the kit.
  type: list
  elements: dict
  returned: always
  sample: [{"port": 18100, "address": "0.0.0.0", "pid": 4242, "process": "python3 -m http.server 18100"}]
own:
  description: Listeners on the ports that belong to the kit's own units.
  type: list
  elements: dict
  returned: always
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.epd.kit.plugins.module_utils.epd_listen import probe


def main() -> None:
    module = AnsibleModule(
        argument_spec={"ports": {"type": "list", "elements": "int", "required": True}}, supports_check_mode=True
    )
    module.exit_json(changed=False, **probe(module, module.params["ports"]))


if __name__ == "__main__":
    main()
