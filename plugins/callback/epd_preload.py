"""Load the kit's filters, and the planner they call, once in ansible-playbook's own process.

ansible-playbook forks a worker per task and host (ansible/utils/multiprocessing.py: the 'fork'
context), and a worker loads a plugin its parent has not loaded (plugins/loader.py
`_load_module_source` reuses only what sys.modules already holds). Without this, every worker that
templates an epd.kit filter imported epd_kit.plan again, about 36 modules (0.1-0.2 CPU-s each time,
many times per deploy: docs/sandbox.md "Where the CPU goes"). Imported here, in the parent,
before the first fork, the workers inherit them. The callback prints nothing and changes nothing.
"""

from __future__ import annotations

from ansible.plugins.callback import CallbackBase
from ansible_collections.epd.kit.plugins.filter import epd_firewall, epd_kit, epd_observability  # noqa: F401

DOCUMENTATION = r"""
name: epd_preload
type: aggregate
short_description: load the kit's filters once, before ansible-playbook forks its workers
description:
  - Imports the epd.kit filter plugins and the planner they call (epd_kit.plan) in the controller's
    main process, so the worker forked for each task and host inherits them instead of importing
    them again.
  - Prints nothing and changes nothing. Enabled by the repository's ansible.cfg (callbacks_enabled);
    a controller without it runs the same playbooks with the same results, only with more CPU.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "epd.kit.epd_preload"
    CALLBACK_NEEDS_ENABLED = True
