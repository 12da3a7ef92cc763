#!/usr/bin/python
"""epd_transfer_probe: can an engine venv move embeddings (NIXL over LIBFABRIC), and is EFA there?"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_transfer_probe
short_description: Check NIXL, its LIBFABRIC plugin's libraries and the EFA libfabric provider for an engine venv
description:
  - Runs the given Python with O(library_path) on C(LD_LIBRARY_PATH) (where the engines find
    libfabric and the CUDA stub) the way an engine starts, C(import torch) first (vllm imports it
    before NIXL; skipped when torch is not installed), then C(import nixl), and checks that each of
    O(libraries) loads. nixl 1.5's meta package picks its backend (C(nixl_cu12), C(nixl_cu13))
    from torch's CUDA major at import (its C(nixl/__init__.py)); the backend it chose is returned.
  - With O(backend=LIBFABRIC), runs the vLLM Neuron setup guide's two checks
    (vllm-neuron/docs/getting-started/setup-guide.md, "Verify the LIBFABRIC backend loads") on
    the plugin of THAT backend, the one NIXL loads (C($NIXL_PLUGIN_DIR), else C(plugins/) beside
    the loaded C(libnixl.so), as in nixl's src/core/nixl_plugin_manager.cpp, C(getPluginDir)).
    In C(ldd) of its C(libplugin_LIBFABRIC.so), a library or symbol version that is C(not found) is
    a problem named with its fix, except the CUDA runtime (C(libcudart.so.N)), which the guide
    lets stay unresolved ("Entries such as libcudart.so.13 are used only by the GPUDirect path
    and can be left unresolved on Neuron") when the process already has it loaded after
    C(import torch) (a CUDA build of torch loads it), so the plugin's C(dlopen) finds it; that
    case is returned as a note. The plugin is then loaded as NIXL loads it
    (C(RTLD_NOW|RTLD_LOCAL|RTLD_NODELETE)), and, with O(agent), the agent is created (torch first),
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
    description: C(LIBFABRIC) also scans and loads NIXL's LIBFABRIC plugin; empty skips it.
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
  description: What is missing for NIXL over LIBFABRIC, each with its fix (empty when everything checked works).
  type: list
  elements: str
  returned: always
notes:
  description: Unresolved plugin libraries the setup guide accepts and the process has loaded (not problems).
  type: list
  elements: str
  returned: always
  sample: ["NIXL's LIBFABRIC plugin: libcudart.so.13 => not found, but import torch loaded it ..."]
nixl:
  description: The NIXL backend C(import nixl) chose (null when the import failed) and the torch it saw.
  type: dict
  returned: always
  sample: {"backend": "nixl_cu13", "torch": "2.11.0+cu130", "torch_cuda": "13.0"}
plugin:
  description: >-
    The backend's LIBFABRIC plugin, the ldd lines that say C(not found), the unresolved libraries
    the process had loaded (soname -> file), and whether the plugin loads as NIXL loads it (null when not tried).
  type: dict
  returned: always
  sample:
    path: /opt/epd/engine-venv/lib/python3.12/site-packages/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so
    not_found: ["libcudart.so.13 => not found"]
    loaded: {"libcudart.so.13": "/opt/epd/engine-venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"}
    loads: true
    error: ""
agent:
  description: Whether the agent was created (null when not tried) and the end of its output.
  type: dict
  returned: always
efa:
  description: Whether C(fi_info -p efa) found the EFA provider, its exit code and (trimmed) output.
  type: dict
  returned: always
  sample: {"found": false, "rc": 127, "output": "fi_info not found (PATH, /opt/amazon/efa/bin)"}
"""

import json
import os
import re

from ansible.module_utils.basic import AnsibleModule

# Runs inside the engine venv's interpreter as an engine starts (torch, then nixl) and prints one
# JSON object of facts; the module judges them. argv[1]: {"libraries", "ldd" (null: no plugin scan)}.
PROBE = r"""
import ctypes, importlib, importlib.util, json, os, subprocess, sys
args = json.loads(sys.argv[1])
facts = {"problems": [], "backend": None, "torch": None, "torch_cuda": None, "plugin": None,
         "not_found": [], "loaded": {}, "loads": None, "error": ""}

def mapped():
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}

def loaded_from(soname):
    # the loader's own answer (RTLD_NOLOAD: an object with this soname is resident, so a DT_NEEDED
    # entry naming it is satisfied without a search) and the file it came from (/proc/self/maps)
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None
    files = sorted(p for p in mapped() if os.path.basename(p).startswith(soname))
    return files[0] if files else "(loaded, file not identified)"

if importlib.util.find_spec("torch") is not None:
    try:
        import torch
        facts["torch"] = str(getattr(torch, "__version__", ""))
        facts["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    except Exception as error:
        facts["problems"].append(f"import torch failed ({error})")
try:
    import nixl  # noqa: F401
    # the meta package aliases nixl._api to its backend's module (nixl_cu13._api); an older nixl is its own backend
    facts["backend"] = importlib.import_module("nixl._api").__name__.rpartition(".")[0]
except Exception as error:
    facts["problems"].append(f"import nixl failed ({error})")
if facts["backend"] and args["ldd"]:
    # nixl's getPluginDir: $NIXL_PLUGIN_DIR, else plugins/ beside the libnixl.so the backend loaded
    libnixl = sorted(os.path.dirname(p) for p in mapped() if os.path.basename(p) == "libnixl.so")
    directory = os.environ.get("NIXL_PLUGIN_DIR") or (libnixl and os.path.join(libnixl[0], "plugins"))
    plugin = directory and os.path.join(directory, "libplugin_LIBFABRIC.so")
    if plugin and os.path.exists(plugin):
        facts["plugin"] = plugin
        ldd = subprocess.run([args["ldd"], plugin], capture_output=True, text=True)
        facts["not_found"] = [l.strip() for l in (ldd.stdout + ldd.stderr).splitlines() if "not found" in l]
        for line in facts["not_found"]:
            if " => not found" in line:
                facts["loaded"][line.split()[0]] = loaded_from(line.split()[0])
        try:
            ctypes.CDLL(plugin, mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_NODELETE)  # as nixl's plugin manager
            facts["loads"] = True
        except OSError as error:
            facts["loads"], facts["error"] = False, str(error)
    else:
        facts["problems"].append(
            f"no libplugin_LIBFABRIC.so in {directory or 'the plugin directory of ' + facts['backend']} "
            f"(the NIXL backend {facts['backend']} loads its plugins from there)")
for lib in args["libraries"]:
    try:
        ctypes.CDLL(lib)
    except OSError as error:
        facts["problems"].append(f"{lib} does not load ({error})")
print(json.dumps(facts))
"""
# the setup guide's agent check, run as an engine runs it: torch imported first when installed
AGENT_CHECK = (
    "import importlib.util\n"
    "if importlib.util.find_spec('torch'):\n"
    "    import torch  # noqa: F401\n"
    "from nixl._api import nixl_agent, nixl_agent_config; "
    "nixl_agent('probe', nixl_agent_config(backends=['LIBFABRIC'])); print('LIBFABRIC OK')"
)
EFA_BIN = "/opt/amazon/efa/bin"
# the CUDA runtime: the one kind of `not found` entry the setup guide lets stay unresolved
CUDA_RUNTIME = re.compile(r"libcudart\.so\.\d+")
NOT_FOUND = re.compile(r"^(\S+) => not found|version `([^']+)' not found")
# what to do about a library the plugin cannot find (the setup guide's two libraries, and hwloc)
FIXES = {
    "libcuda.so.1": "install the CUDA driver stub (cuda-cudart-dev-12-6, linked as /usr/local/lib/libcuda.so.1)",
    "libcudart.so": (
        "nor loaded by `import torch` (a CUDA build of torch loads it, and then the setup guide lets it stay "
        "unresolved): install the torch the release pins, or put the CUDA runtime's directory on the engines' "
        "loader path"
    ),
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


def probe(module, python, libraries, ldd, env):
    """The facts PROBE gathers in the engine venv's interpreter."""
    if not os.access(python, os.X_OK):
        return {"problems": [f"{python} is not an executable interpreter"]}
    argv = [python, "-c", PROBE, json.dumps({"libraries": list(libraries), "ldd": ldd})]
    rc, out, err = module.run_command(argv, environ_update=env)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"problems": [f"{python} could not run the NIXL check (rc {rc}): {(err or out).strip()[-300:]}"]}


def missing_name(line):
    """The library (`libX.so.1 => not found`) or symbol version (`version `FABRIC_1.10' not found`) of an ldd line."""
    match = NOT_FOUND.search(line)
    return (match.group(1) or match.group(2)) if match else line


def fix_for(line):
    name = missing_name(line)
    return next((fix for key, fix in FIXES.items() if key in name), "add its directory to the loader path")


def judge_plugin(facts):
    """(problems, notes) of the plugin's ldd lines, judged as the setup guide judges them."""
    problems, notes = [], []
    for line in facts.get("not_found", []):
        soname = missing_name(line)
        if CUDA_RUNTIME.fullmatch(soname) and facts["loaded"].get(soname):
            notes.append(
                f"NIXL's LIBFABRIC plugin: {line}, but the process has it loaded after `import torch` "
                f"({facts['loaded'][soname]}), so the plugin's dlopen finds it (the setup guide lets "
                f"libcudart stay unresolved on Neuron)"
            )
        elif CUDA_RUNTIME.fullmatch(soname):
            problems.append(f"NIXL's LIBFABRIC plugin: {line}, {fix_for(line)}")
        else:
            problems.append(f"NIXL's LIBFABRIC plugin: {line} ({fix_for(line)})")
    if facts.get("loads") is False and not problems:
        problems.append(f"NIXL's LIBFABRIC plugin does not load as NIXL loads it ({facts['error']})")
    return problems, notes


def agent_probe(module, python, env):
    rc, out, err = module.run_command([python, "-c", AGENT_CHECK], environ_update=env)
    # NIXL's log lines and the exception, without the traceback's frames (they crowd out the reason)
    lines = [line for line in f"{err}\n{out}".splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    tail = "\n".join(lines)[-600:]
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
    scan = params["backend"] == "LIBFABRIC"
    ldd = module.get_bin_path("ldd") if scan else None
    facts = probe(module, params["python"], params["libraries"], ldd, env)
    problems, notes = list(facts["problems"]), []
    if scan and ldd is None:
        problems.append("ldd is missing (libc-bin/glibc-common): cannot scan NIXL's LIBFABRIC plugin")
    plugin = {key: facts.get(key) for key in ("not_found", "loaded", "loads", "error")}
    plugin["path"] = facts.get("plugin")
    agent = {"created": None, "output": ""}
    if scan and facts.get("plugin"):
        plugin_problems, notes = judge_plugin(facts)
        problems += plugin_problems
        if params["agent"] and not problems:
            agent, agent_problems = agent_probe(module, params["python"], env)
            problems += agent_problems
    nixl = {key: facts.get(key) for key in ("backend", "torch", "torch_cuda")}
    module.exit_json(
        changed=False,
        problems=problems,
        notes=notes,
        nixl=nixl,
        plugin=plugin,
        agent=agent,
        efa=efa_provider(module, env),
    )


if __name__ == "__main__":
    main()
