#!/usr/bin/python
"""epd_transfer_probe: can an engine venv move embeddings (NIXL over LIBFABRIC), and is EFA there?"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_transfer_probe
short_description: Check NIXL, its LIBFABRIC plugin's libraries and the EFA libfabric provider for an engine venv
description:
  - Runs the given Python with O(library_path) on C(LD_LIBRARY_PATH) (where the engines find
    libfabric and the CUDA stub) and checks that C(import nixl) works and that each of
    O(libraries) loads.
  - With O(backend=LIBFABRIC), runs the vLLM Neuron setup guide's two checks
    (vllm-neuron/docs/getting-started/setup-guide.md, "Verify the LIBFABRIC backend loads"),
    C(ldd) of the wheel's C(libplugin_LIBFABRIC.so) for libraries or symbol versions that are
    C(not found), and, with O(agent), the agent creation
    C(nixl_agent('probe', nixl_agent_config(backends=['LIBFABRIC']))). Without those an engine
    fails at startup with "unsupported backend 'LIBFABRIC'".
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
  library_path:
    description: Directories put in front of C(LD_LIBRARY_PATH), as in the engines' environment.
    type: list
    elements: path
    default: [/opt/amazon/efa/lib64, /opt/amazon/efa/lib]
  backend:
    description: C(LIBFABRIC) also scans NIXL's LIBFABRIC plugin with ldd; empty skips it.
    type: str
    default: ""
    choices: ["", LIBFABRIC]
  agent:
    description: With O(backend), also create a NIXL agent with that backend (needs a libfabric provider).
    type: bool
    default: true
author: epd-kit
"""

EXAMPLES = r"""
- name: Check NIXL's LIBFABRIC backend in the engine venv
  epd.kit.epd_transfer_probe:
    python: /opt/epd/engine-venv/bin/python
    libraries: [libfabric.so.1, libcuda.so.1]
    backend: LIBFABRIC
  register: epd_probe
"""

RETURN = r"""
problems:
  description: What is missing for NIXL over LIBFABRIC (empty when everything checked works).
  type: list
  elements: str
  returned: always
plugin:
  description: The LIBFABRIC plugin found in the venv and the ldd lines that say C(not found).
  type: dict
  returned: always
  sample: {"path": "/opt/epd/engine-venv/.../libplugin_LIBFABRIC.so", "not_found": ["libcuda.so.1 => not found"]}
agent:
  description: Whether the agent was created (null when not tried) and the end of its output.
  type: dict
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
# the plugin file of the installed NIXL wheel (the setup guide's `find ... -name libplugin_LIBFABRIC.so`)
FIND_PLUGIN = r"""
import os, site
for root in site.getsitepackages():
    for path, dirs, files in os.walk(root):
        if "libplugin_LIBFABRIC.so" in files:
            print(os.path.join(path, "libplugin_LIBFABRIC.so"))
            raise SystemExit(0)
"""
# the setup guide's agent check, verbatim
AGENT_CHECK = (
    "from nixl._api import nixl_agent, nixl_agent_config; "
    "nixl_agent('probe', nixl_agent_config(backends=['LIBFABRIC'])); print('LIBFABRIC OK')"
)
EFA_BIN = "/opt/amazon/efa/bin"
# what to do about a library the plugin cannot find (the setup guide's two libraries, and hwloc)
FIXES = {
    "libcuda.so.1": "install the CUDA driver stub (cuda-cudart-dev-12-6, linked as /usr/local/lib/libcuda.so.1)",
    "libcudart.so": "put the CUDA runtime's directory on the engines' loader path",
    "libfabric.so.1": (
        "install libfabric with the EFA installer (without --minimal); the engines' loader path has "
        "/opt/amazon/efa/lib64:/opt/amazon/efa/lib"
    ),
    "libhwloc.so.15": "install hwloc's library (libhwloc15; Amazon Linux: hwloc-libs)",
    "FABRIC_": "this libfabric is older than the plugin needs: use the EFA installer's libfabric under /opt/amazon/efa",
}


def environment(library_path):
    paths = [p for p in library_path if p] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return {"LD_LIBRARY_PATH": ":".join(paths)} if paths else {}


def nixl_problems(module, python, libraries, env):
    if not os.access(python, os.X_OK):
        return [f"{python} is not an executable interpreter"]
    rc, out, err = module.run_command([python, "-c", NIXL_CHECK] + list(libraries), environ_update=env)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [f"{python} could not run the NIXL check (rc {rc}): {(err or out).strip()[-300:]}"]


def fix_for(line):
    return next((fix for key, fix in FIXES.items() if key in line), "add its directory to the loader path")


def plugin_scan(module, python, env):
    """ldd of the LIBFABRIC plugin: every `not found` line, each with its fix."""
    rc, out, err = module.run_command([python, "-c", FIND_PLUGIN], environ_update=env)
    path = out.strip().splitlines()[0] if rc == 0 and out.strip() else None
    if path is None:
        return {"path": None, "not_found": []}, ["no libplugin_LIBFABRIC.so in the venv: install NIXL (nixl-cu12)"]
    ldd = module.get_bin_path("ldd")
    if ldd is None:
        return {"path": path, "not_found": []}, ["ldd is missing (libc-bin/glibc-common): cannot scan the plugin"]
    rc, out, err = module.run_command([ldd, path], environ_update=env)
    missing = [line.strip() for line in (out + "\n" + err).splitlines() if "not found" in line]
    problems = [f"NIXL's LIBFABRIC plugin: {line} ({fix_for(line)})" for line in missing]
    return {"path": path, "not_found": missing}, problems


def agent_probe(module, python, env):
    rc, out, err = module.run_command([python, "-c", AGENT_CHECK], environ_update=env)
    tail = ((err or "") + (out or "")).strip()[-400:]
    if rc == 0 and "LIBFABRIC OK" in out:
        return {"created": True, "output": tail}, []
    return {"created": False, "output": tail}, [f"the NIXL agent with the LIBFABRIC backend was not created: {tail}"]


def efa_provider(module, env):
    fi_info = module.get_bin_path("fi_info", opt_dirs=[EFA_BIN])
    if fi_info is None:
        return {"found": False, "rc": 127, "output": f"fi_info not found (PATH, {EFA_BIN})"}
    rc, out, err = module.run_command([fi_info, "-p", "efa"], environ_update=env)
    return {"found": rc == 0, "rc": rc, "output": ((err or "") + (out or "")).strip()[:200]}


def main():
    module = AnsibleModule(
        argument_spec={
            "python": {"type": "path", "required": True},
            "libraries": {"type": "list", "elements": "str", "default": ["libfabric.so.1"]},
            "library_path": {
                "type": "list",
                "elements": "path",
                "default": ["/opt/amazon/efa/lib64", "/opt/amazon/efa/lib"],
            },
            "backend": {"type": "str", "default": "", "choices": ["", "LIBFABRIC"]},
            "agent": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    params = module.params
    env = environment(params["library_path"])
    problems = nixl_problems(module, params["python"], params["libraries"], env)
    plugin, agent = {"path": None, "not_found": []}, {"created": None, "output": ""}
    if params["backend"] == "LIBFABRIC" and not problems:
        plugin, plugin_problems = plugin_scan(module, params["python"], env)
        problems += plugin_problems
        if params["agent"] and not plugin_problems:
            agent, agent_problems = agent_probe(module, params["python"], env)
            problems += agent_problems
    module.exit_json(changed=False, problems=problems, plugin=plugin, agent=agent, efa=efa_provider(module, env))


if __name__ == "__main__":
    main()
