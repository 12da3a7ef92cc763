#!/usr/bin/python
"""epd_transfer_probe: can an engine venv move embeddings (NIXL over LIBFABRIC), and is EFA there?"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_transfer_probe
short_description: Check NIXL, its runtime libraries and the EFA libfabric provider for an engine venv
description:
  - Runs the given Python and checks that C(import nixl) works and that each of O(libraries)
    loads (NIXL's LIBFABRIC backend loads them at runtime; an engine without them fails at
    startup with "unsupported backend 'LIBFABRIC'").
  - Runs C(fi_info -p efa) (also under /opt/amazon/efa/bin) to find the EFA provider, without
    which the VE->PD embedding transfer stalls (ECLoadFailure on PD).
  - Read-only; supports check mode. The caller decides what is fatal.
options:
  python:
    description: The interpreter of the venv the engines run in.
    type: path
    required: true
  libraries:
    description: Shared libraries that must load in that interpreter.
    type: list
    elements: str
    default: [libfabric.so.1]
author: epd-kit
"""

EXAMPLES = r"""
- name: Check NIXL, libfabric and libcuda in the engine venv
  epd.kit.epd_transfer_probe:
    python: /opt/aws_neuronx_venv_pytorch_inference_vllm/bin/python
    libraries: [libfabric.so.1, libcuda.so.1]
  register: epd_probe
"""

RETURN = r"""
problems:
  description: What is missing for NIXL over LIBFABRIC (empty when NIXL imports and every library loads).
  type: list
  elements: str
  returned: always
efa:
  description: Whether C(fi_info -p efa) found the EFA provider, its exit code and (trimmed) output.
  type: dict
  returned: always
  sample: {"found": false, "rc": 127, "output": "fi_info: command not found"}
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule

# Runs inside the engine venv's interpreter: prints the problems as one JSON list.
NIXL_CHECK = r"""
import ctypes, json, sys
problems = []
try:
    import nixl  # noqa: F401
except Exception as error:
    problems.append(f"import nixl failed ({error})")
for lib in sys.argv[1:]:
    try:
        ctypes.CDLL(lib)
    except OSError as error:
        problems.append(f"{lib} does not load ({error})")
print(json.dumps(problems))
"""
EFA_BIN = "/opt/amazon/efa/bin"


def nixl_problems(module, python, libraries):
    if not os.access(python, os.X_OK):
        return [f"{python} is not an executable interpreter"]
    rc, out, err = module.run_command([python, "-c", NIXL_CHECK] + list(libraries))
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [f"{python} could not run the NIXL check (rc {rc}): {(err or out).strip()[-300:]}"]


def efa_provider(module):
    fi_info = module.get_bin_path("fi_info", opt_dirs=[EFA_BIN])
    if fi_info is None:
        return {"found": False, "rc": 127, "output": f"fi_info not found (PATH, {EFA_BIN})"}
    rc, out, err = module.run_command([fi_info, "-p", "efa"])
    return {"found": rc == 0, "rc": rc, "output": ((err or "") + (out or "")).strip()[:200]}


def main():
    module = AnsibleModule(
        argument_spec={
            "python": {"type": "path", "required": True},
            "libraries": {"type": "list", "elements": "str", "default": ["libfabric.so.1"]},
        },
        supports_check_mode=True,
    )
    module.exit_json(
        changed=False,
        problems=nixl_problems(module, module.params["python"], module.params["libraries"]),
        efa=efa_provider(module),
    )


if __name__ == "__main__":
    main()
