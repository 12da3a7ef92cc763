"""Split a planner argv into the EPD_* variables that epd-engine@.service names.

The template unit's ExecStart is fixed (templates/epd-engine@.service.j2); this filter maps
one engine's argv (planner output, docs/architecture.md) onto it and proves the mapping by
rebuilding the argv exactly as systemd will expand it. A planner argv the unit cannot
express (reordered flags, whitespace in a bare flag) fails here, before any file is written.
"""
from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

# flag -> variable, in ExecStart order; each is `--flag ${VAR}` (one argument)
VALUED_FLAGS_BEFORE_ROLE: tuple[tuple[str, str], ...] = (
    ("--tensor-parallel-size", "EPD_TENSOR_PARALLEL_SIZE"),
    ("--host", "EPD_HOST"),
    ("--port", "EPD_PORT"),
    ("--max-model-len", "EPD_MAX_MODEL_LEN"),
    ("--max-num-batched-tokens", "EPD_MAX_NUM_BATCHED_TOKENS"),
    ("--max-num-seqs", "EPD_MAX_NUM_SEQS"),
    ("--dtype", "EPD_DTYPE"),
    ("--limit-mm-per-prompt", "EPD_LIMIT_MM_PER_PROMPT"),
)
PREFIX_CACHING_OFF = "--no-enable-prefix-caching"
VALUED_FLAGS_AFTER_ROLE: tuple[tuple[str, str], ...] = (
    ("--additional-config", "EPD_ADDITIONAL_CONFIG"),
    ("--ec-transfer-config", "EPD_EC_TRANSFER_CONFIG"),
)
WILDCARD_ADDRESSES = {"0.0.0.0", "::", "[::]", ""}


def expand(executable: str, layout: dict[str, Any]) -> list[str]:
    """The argv systemd runs for this layout (mirror of the unit's ExecStart)."""
    variables = layout["variables"]
    argv = [executable, "serve", variables["EPD_MODEL"]]
    for flag, name in VALUED_FLAGS_BEFORE_ROLE:
        argv += [flag, variables[name]]
    argv.append(PREFIX_CACHING_OFF)
    argv += layout["role_args"]
    for flag, name in VALUED_FLAGS_AFTER_ROLE:
        argv += [flag, variables[name]]
    return argv + layout["extra_args"]


def epd_engine_layout(engine: dict[str, Any], executable: str, start_timeout_s: int = 3600) -> dict[str, Any]:
    """Return {variables, role_args, extra_args, health_host, argv, env_file} for one planned engine.

    env_file is every assignment of /etc/epd/engines/<instance>.env, in file order: the
    planner's process environment, the argv pieces, then the unit's plumbing (stagger,
    readiness URL and its time budget, which leaves the stagger and a margin to systemd's
    TimeoutStartSec=start_timeout_s).
    """
    argv = [str(token) for token in engine["argv"]]
    where = f"engine {engine.get('engine_id', '?')}"
    if len(argv) < 3 or argv[1] != "serve":
        raise AnsibleFilterError(f"{where}: planner argv must start with '<exe> serve MODEL', got {argv[:3]}")
    valued = dict(VALUED_FLAGS_BEFORE_ROLE + VALUED_FLAGS_AFTER_ROLE)
    variables: dict[str, str] = {"EPD_MODEL": argv[2]}
    role_args: list[str] = []
    extra_args: list[str] = []
    tail = argv[3:]
    index, after_ec = 0, False
    while index < len(tail):
        token = tail[index]
        if after_ec:
            extra_args.append(token)
        elif token in valued and index + 1 < len(tail):
            variables[valued[token]] = tail[index + 1]
            after_ec = token == "--ec-transfer-config"
            index += 1
        elif token != PREFIX_CACHING_OFF:
            role_args.append(token)
        index += 1
    missing = [name for name in valued.values() if name not in variables]
    if missing:
        raise AnsibleFilterError(f"{where}: planner argv lacks {missing}; the engine unit needs every one of them")
    for token in role_args + extra_args:
        if not token or any(ch.isspace() for ch in token):
            raise AnsibleFilterError(
                f"{where}: argument {token!r} is empty or contains whitespace; systemd splits role and extra "
                "arguments on whitespace, so pass it as a separate list item without spaces")
    host = engine.get("host") or "127.0.0.1"
    layout = {
        "variables": variables,
        "role_args": role_args,
        "extra_args": extra_args,
        "health_host": "127.0.0.1" if host in WILDCARD_ADDRESSES else host,
    }
    layout["argv"] = expand(executable, layout)
    delay = int(engine.get("start_delay_s") or 0)
    url_host = f"[{layout['health_host']}]" if ":" in layout["health_host"] else layout["health_host"]
    env_file = {str(name): str(value) for name, value in sorted(dict(engine.get("env") or {}).items())}
    env_file.update(sorted(variables.items()))
    env_file.update({
        "EPD_ROLE_ARGS": " ".join(role_args),
        "EPD_EXTRA_ARGS": " ".join(extra_args),
        "EPD_START_DELAY_S": str(delay),
        "EPD_HEALTH_URL": f"http://{url_host}:{engine['port']}/health",
        "EPD_READY_TIMEOUT_S": str(max(int(start_timeout_s) - delay - 15, 30)),
    })
    for name, value in env_file.items():
        if "\n" in value or "\r" in value:
            raise AnsibleFilterError(f"{where}: {name} contains a line break, which an EnvironmentFile cannot hold")
    layout["env_file"] = env_file
    if layout["argv"][1:] != argv[1:]:
        raise AnsibleFilterError(
            f"{where}: the engine unit would run {layout['argv'][1:]} but the planner asked for {argv[1:]}; "
            "flags must follow the order of the unit's ExecStart (templates/epd-engine@.service.j2)")
    return layout


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"epd_engine_layout": epd_engine_layout}
