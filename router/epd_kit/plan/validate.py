"""Checks of every declared variable (variables.py) beyond the planner's own: values, dict keys,
scopes, ports on each machine, name lengths and rollout settings.

Part of the inventory check (checks.py), so plan.yml, render.yml, deploy's controller
preflight and --check refuse these before any host is contacted. Each problem is one line
naming the host(s), the variable and the fix.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from .errors import EpdPlanError
from .hints import did_you_mean
from .net import is_loopback
from .rollout import POOLS, amount, pool_sizes, resolve_pool
from .router_check import router_section_problems
from .values import as_int, describe, plain, unresolved
from .variables import (
    ABSOLUTE,
    ADDRESS,
    AMOUNT,
    ANY,
    AUTO_BOOL,
    BOOL,
    DICT,
    DURATION_UNITS,
    ENGINE,
    FINGERPRINT,
    FLEET,
    FLOAT,
    GROUP_SCOPES,
    INT,
    INTERNAL,
    LIST,
    LOADBALANCER,
    MILLISECONDS,
    MINUTES,
    NAME,
    PATH,
    PLANNED_KEYS,
    PORT,
    ROUTER,
    ROUTER_SECTIONS,
    SECONDS,
    SHA256,
    STR,
    URL,
    VARIABLES,
    VERSION,
    Var,
)

# Ansible's `| bool` reads these strings (and -e passes every value as a string)
BOOL_STRINGS = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0", "y", "n", "t", "f"})
WITH_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")
UNIT_SECONDS = {"ms": 0.001, "s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60, "h": 3600, "d": 86400}
# provision.yml gives the precompile hosts the engine hosts' venv from the same engine variables
PRECOMPILE = "epd_precompile"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# NAME_MAX of Linux file systems: an inventory name is a directory name on the controller
# (render.yml's RENDER_DIR/<host>, Ansible's fact cache)
MAX_NAME_BYTES = 255


def hosts_text(hosts: Sequence[str]) -> str:
    return ", ".join(hosts) if len(hosts) <= 3 else f"{', '.join(hosts[:3])} and {len(hosts) - 3} more"


def explicit(hostvars: Mapping[str, Any], host: str) -> dict[str, Any]:
    """The declared variables set for `host` (inventory or -e), as plain values; a value Ansible cannot
    template here is left to the role that reads it."""
    out = {}
    variables = hostvars[host]
    for name in list(variables):
        if str(name) in VARIABLES:
            try:
                value = plain(variables[name])
            except Exception:  # Ansible's templating errors: the role that reads the value reports them
                continue
            if not unresolved(value):
                out[str(name)] = value
    return out


# --------------------------------------------------------------------------- forms

# the pin shape apt, pip and the EFA installer's file name take (epd_provision's own check)
VERSION_TEXT = re.compile(r"[0-9][0-9A-Za-z.+!~-]*")
UNIX_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")


def _url(var: Var, text: str) -> str | None:
    parts = urlsplit(text)
    if parts.scheme not in var.schemes:
        schemes = " or ".join(f"{scheme}://" for scheme in var.schemes)
        return f"a URL starting with {schemes}" + (f" (e.g. https://{text})" if "://" not in text else "")
    if parts.scheme != "file" and not parts.hostname:
        return "a URL with a host name"
    if any(c.isspace() for c in text):
        return "a URL without spaces"
    return None


def _address(text: str) -> str | None:
    if re.fullmatch(r"[0-9.]+", text):
        try:
            ipaddress.IPv4Address(text)
        except ValueError:
            return "an IPv4 address (four numbers 0-255) or a host name"
        return None
    try:
        ipaddress.ip_address(text.strip("[]"))
        return None
    except ValueError:
        pass
    return None if HOST_NAME.fullmatch(text) else "an IP address or a host name"


def form_problem(var: Var, value: Any, where: str | None = None, item: bool = False) -> str | None:
    """What is wrong with the shape of one scalar of `var` (its form, or a PATH's absoluteness), or None."""
    form = ABSOLUTE if var.kind == PATH else var.form
    where = where or var.name
    if form is None:
        return None
    if form == AUTO_BOOL:
        if isinstance(value, bool) or str(value).strip().lower() in {"auto", *BOOL_STRINGS}:
            return None
        return f"{where} is {value!r}: write auto, true or false"
    text = str(value)
    if text == "" and not var.default and form != NAME and not item:
        return None  # unset: the kit's default applies
    wanted: str | None
    if form == VERSION:
        wanted = None if VERSION_TEXT.fullmatch(text) else "a version such as 2.30.2.0 (digits first, no spaces)"
    elif form == SHA256:
        wanted = None if re.fullmatch(r"[0-9a-f]{64}", text) else "64 lowercase hex digits (sha256sum's output)"
        if wanted and re.fullmatch(r"[0-9A-Fa-f]{64}", text):
            return f"{where} is {value!r}: write it in lowercase, as sha256sum prints it: {text.lower()}"
    elif form == FINGERPRINT:
        compact = re.sub(r"\s", "", text)
        wanted = None if re.fullmatch(r"[0-9A-Fa-f]{40}", compact) else "40 hex digits (gpg --fingerprint)"
    elif form == URL:
        wanted = _url(var, text)
    elif form == ABSOLUTE:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):  # s3://bucket/..., nfs://...: no example built from it
            wanted = (
                "an absolute path on the host, not a URL: mount the store on every host that reads it "
                "(NFS, FSx, a file gateway) and give the mount's directory"
            )
        elif not text.startswith("/"):
            wanted = (
                f"an absolute path (e.g. /{text.lstrip('./~')}): a relative one depends on the directory a task runs in"
            )
        else:
            wanted = "one line" if "\n" in text else None
    elif form == NAME:
        wanted = None if UNIX_NAME.fullmatch(text) else "a user or group name (lowercase letters, digits, _ and -)"
    elif form == ADDRESS:
        wanted = _address(text)
    else:
        wanted = None
    return f"{where} is {value!r}: write {wanted}" if wanted else None


def _items_form_problem(var: Var, value: Any) -> str | None:
    """The form of each item of a list, or each value of a mapping without declared keys."""
    if var.form is None and var.kind != PATH:
        return None
    items = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, Mapping) else ()
    for key, item in items:
        where = f"{var.name}[{key!r}]" if isinstance(key, str) else f"{var.name}[{key}]"
        problem = form_problem(var, item, where, item=True)
        if problem:
            return problem
    return None


def _ini_hint(value: Any) -> str:
    """A list or mapping that arrived as text: an INI inventory passes a value it cannot parse (YAML's
    flow style, `{total_s: 10}`) as a string."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        return (
            ": an INI inventory passes a list or mapping it cannot parse as text; write it as JSON "
            '({"total_s": 10}) or in a YAML file (group_vars/*.yml)'
        )
    return ""


# --------------------------------------------------------------------------- one value


def _duration(var: Var, value: Any) -> str | None:
    unit = DURATION_UNITS[var.kind]
    word = {SECONDS: "seconds", MILLISECONDS: "milliseconds", MINUTES: "minutes"}[var.kind]
    match = WITH_UNIT.match(value) if isinstance(value, str) else None
    if match:
        given = match[2].lower()
        if given in UNIT_SECONDS:
            scale = {SECONDS: 1, MILLISECONDS: 0.001, MINUTES: 60}[var.kind]
            converted = float(match[1]) * UNIT_SECONDS[given] / scale
            shown = f"{converted:g}"
            return (
                f"{var.name} is {value!r}: a whole number of {word} without a unit (the name ends in _{unit}); "
                f"write {shown}"
            )
        return f"{var.name} is {value!r}: a whole number of {word} without a unit (the name ends in _{unit})"
    if isinstance(value, float) and not value.is_integer():
        return f"{var.name} is {value!r}: a whole number of {word}"
    try:
        as_int(var.name, int(value) if isinstance(value, float) else value, minimum=var.minimum, maximum=var.maximum)
    except EpdPlanError as error:
        return str(error)
    return None


def _number(var: Var, value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            unit = " without a unit" if WITH_UNIT.match(value) else ""
            return f"{var.name} must be a number{unit}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{var.name} must be a number, got {describe(value)}"
    if var.minimum is not None and value < var.minimum:
        return f"{var.name} must be >= {var.minimum:g}, got {value}"
    if var.maximum is not None and value > var.maximum:
        return f"{var.name} must be <= {var.maximum:g}, got {value}"
    return None


def value_problem(var: Var, value: Any) -> str | None:
    """What is wrong with one value of `var`, or None. None values mean unset and pass."""
    if value is None or (var.kind == ANY and var.form is None):
        return None
    if var.kind in DURATION_UNITS:
        return _duration(var, value)
    if var.kind in (INT, PORT):
        try:
            as_int(var.name, value, minimum=var.minimum, maximum=var.maximum)
        except EpdPlanError as error:
            return str(error)
        return None
    if var.kind == FLOAT:
        return _number(var, value)
    if var.kind == BOOL:
        if isinstance(value, bool) or str(value).strip().lower() in BOOL_STRINGS:
            return None
        return f"{var.name} must be true or false, got {describe(value)}"
    if var.kind in (STR, PATH):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return f"{var.name} must be a string, got {describe(value)}"
        if var.choices and str(value) not in var.choices:
            return f"{var.name} must be one of {', '.join(var.choices)}, got {value!r}"
        return form_problem(var, value)
    if var.kind == LIST:
        if not isinstance(value, list):
            return f"{var.name} must be a list, got {describe(value)}{_ini_hint(value)}"
        return _items_form_problem(var, value)
    if var.kind == DICT:
        if not isinstance(value, Mapping):
            return f"{var.name} must be a mapping, got {describe(value)}{_ini_hint(value)}"
        return "; ".join(key_problems(var, value)) or _items_form_problem(var, value)
    if var.form is not None:  # ANY with a form
        return form_problem(var, value)
    if var.kind == AMOUNT:
        try:
            amount(value, 100, var.name, round_up=True)
        except EpdPlanError as error:
            return str(error)
        return None
    return None


# --------------------------------------------------------------------------- keys of dict variables


def _section_problems(where: str, section: str, value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{where} must be a mapping of {section} settings, got {describe(value)}"]
    allowed = ROUTER_SECTIONS[section]
    problems = []
    typed = {}
    for key, item in value.items():
        path = f"{section}.{key}"
        if path in PLANNED_KEYS:
            problems.append(f"{where} sets {key}: the kit writes {path} from {PLANNED_KEYS[path]}; set that instead")
        elif key not in allowed:
            hint = did_you_mean(str(key), allowed, f"the {section} keys are {', '.join(allowed)}")
            problems.append(f"{where} has unknown key {key}; {hint}")
        else:
            problem = value_problem(Var(f"{where}.{key}", None, allowed[key], ROUTER), item)
            if problem:
                problems.append(problem)
            else:
                typed[key] = item
    # then the router's own model of the section: the rules `epd-router check-config` applies
    return problems + router_section_problems(where, section, typed)


def key_problems(var: Var, value: Mapping[str, Any]) -> list[str]:
    """Every key of a dict variable: a router section's keys, router.yaml's, or environment names."""
    if var.keys in ROUTER_SECTIONS:
        return _section_problems(var.name, var.keys, value)
    if var.keys == "router.yaml":
        problems = []
        for key, item in value.items():
            where = f"{var.name}.{key}"
            if key in PLANNED_KEYS:
                problems.append(f"{var.name} sets {key}: the kit writes it from {PLANNED_KEYS[key]}; set that instead")
            elif key in ROUTER_SECTIONS:
                problems += _section_problems(where, key, item)
            else:
                known = [*ROUTER_SECTIONS, *PLANNED_KEYS]
                problems.append(f"{var.name} has unknown key {key}; {did_you_mean(str(key), known, 'remove it')}")
        return problems
    if var.keys == "environment":
        problems = []
        for key, item in value.items():
            if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
                problems.append(f"{var.name}: {key!r} is not an environment variable name")
            elif isinstance(item, (bool, Mapping, list)) or "\n" in str(item):
                problems.append(f"{var.name}[{key}] must be one line of text or a number, got {describe(item)}")
        return problems
    return []


# --------------------------------------------------------------------------- all hosts


def value_problems(values: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each declared value on each host (the planner's own are checked by the planner), once per
    distinct problem with the hosts that have it."""
    where: dict[str, list[str]] = {}
    for host, variables in values.items():
        for name, value in variables.items():
            var = VARIABLES[name]
            if var.scope == INTERNAL:
                continue
            # the planner checks its own variables' kinds (settings.py, hosts.py); their forms are checked here
            planned = var.spec in ("epd_common.plan", "epd_preflight.controller")
            problem = (
                (form_problem(var, value) if isinstance(value, str) else None) if planned else value_problem(var, value)
            )
            if problem:
                where.setdefault(problem, []).append(host)
    every = len(values) > 1
    return [
        f"{'every host' if every and len(hosts) == len(values) else hosts_text(hosts)}: {problem}"
        for problem, hosts in where.items()
    ]


def scope_problems(values: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Sequence[str]]) -> list[str]:
    """Fleet-wide values that differ between hosts; group values set on a host no play of that group reads."""
    problems = []
    hosts = list(values)
    for name, var in VARIABLES.items():
        if var.scope == FLEET:
            # the hosts whose value is read count unset as the default; any other host only when it
            # sets a value (pool settings may live in group_vars/epd_engines)
            readers = {str(h) for h in groups.get(ENGINE if var.spec else ROUTER) or []}
            seen = {h: values[h].get(name, var.default) for h in hosts if h in readers or name in values[h]}
            if len({repr(v) for v in seen.values()}) > 1:
                shown = ", ".join(f"{h}: {v!r}" for h, v in list(seen.items())[:4])
                problems.append(
                    f"{name} differs between hosts ({shown}); a fleet-wide setting is read from one place: "
                    "set it once in group_vars/all (or -e)"
                )
        elif var.scope in GROUP_SCOPES:
            readers = [*(groups.get(var.scope) or []), *(groups.get(PRECOMPILE) or [] if var.scope == ENGINE else [])]
            members = [str(h) for h in readers if str(h) in values]
            replaced = _replaced_mapping(name, var, values, members)
            if replaced:
                problems.append(replaced)
                continue
            for host in hosts:
                if host in members or name not in values[host]:
                    continue
                # the same value on every reader (or, with no readers, on every host): inherited
                # from a common group such as group_vars/all, not meant for this host alone
                same_as = members or hosts
                if all(repr(values[h].get(name, var.default)) == repr(values[host][name]) for h in same_as):
                    continue
                problems.append(
                    f"{host}: {name} is set but {host} is not in {var.scope}, the group whose plays read it: "
                    f"move it to the variables of a host in {var.scope} (or add {host} to {var.scope})"
                )
    return problems


def _replaced_mapping(
    name: str, var: Var, values: Mapping[str, Mapping[str, Any]], members: Sequence[str]
) -> str | None:
    """A mapping or list of group_vars that some hosts of its group replaced in their own entry: the
    hosts outside the group still hold the group's value (all alike), readers hold another. Said as
    that, not as a value set on hosts outside the group."""
    if var.kind not in (DICT, LIST, ANY):
        return None
    outside = [h for h in values if h not in members and name in values[h]]
    if not outside or len({repr(values[h][name]) for h in outside}) > 1:
        return None
    group_value = values[outside[0]][name]
    own = [h for h in members if name in values[h] and repr(values[h][name]) != repr(group_value)]
    if not own:
        return None
    return (
        f"{hosts_text(own)}: {name} in {'its' if len(own) == 1 else 'their'} own entry replaces the whole {name} "
        f"of group_vars (which {hosts_text(outside)} still {'has' if len(outside) == 1 else 'have'}): Ansible "
        "replaces a mapping or list, it does not merge them; write every entry in one place (the host's entry, "
        f"or group_vars/{var.scope})"
    )


def name_problems(hosts: Iterable[str]) -> list[str]:
    return [
        f"{host[:40]}...: the inventory name is {len(host.encode())} bytes, longer than a file name may be "
        f"({MAX_NAME_BYTES}; render.yml writes RENDER_DIR/<name>): use a shorter name and put the address "
        "in ansible_host"
        for host in hosts
        if len(host.encode()) > MAX_NAME_BYTES
    ]


# --------------------------------------------------------------------------- machines and their ports


def machine_of(host: str, variables: Mapping[str, Any]) -> tuple[str, str]:
    """(address, ssh port) of the machine a host name reaches: letter case and a trailing dot do
    not matter, every loopback name is one machine. A local connection is not taken as loopback:
    the kit's tests stand several hosts in for remote ones that way."""
    address = str(plain(variables["ansible_host"])) if "ansible_host" in variables else host
    address = address.strip().lower().rstrip(".")
    port = str(plain(variables["ansible_port"])) if "ansible_port" in variables else "22"
    return ("loopback" if is_loopback(address) else address, port)


def port_problems(
    plan: Mapping[str, Mapping[str, Any]],
    router_port: int,
    hostvars: Mapping[str, Any],
    groups: Mapping[str, Sequence[str]],
) -> list[str]:
    """Every port a machine listens on (engines, router, HAProxy and its stats page) against every other,
    whatever names the machine has in the inventory."""
    uses: dict[tuple[str, str], dict[int, tuple[str, str]]] = {}
    problems = []

    def use(host: str, port: Any, what: str) -> None:
        machine = machine_of(host, hostvars[host])
        try:
            number = as_int(what, port)
        except EpdPlanError:
            return  # a bad value is value_problems' to report
        held = uses.setdefault(machine, {})
        if number in held and held[number][1] != what:
            names = held[number][0] if held[number][0] == host else f"{held[number][0]} (also {host})"
            problems.append(
                f"{names}: port {number} is used by both {held[number][1]} and {what}; give one of them another port"
            )
        held.setdefault(number, (host, what))

    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            use(host, engine["port"], f"{engine['engine_id']} (HTTP)")
            for rank, port in enumerate(engine["side_channel_ports"]):
                use(host, port, f"{engine['engine_id']} (side channel rank {rank})")
    for host in groups.get(ROUTER) or []:
        use(str(host), router_port, "the router (epd_router_port)")
    for host in groups.get(LOADBALANCER) or []:
        variables = explicit(hostvars, str(host))
        for name, what in (("epd_haproxy_port", "HAProxy"), ("epd_haproxy_stats_port", "HAProxy's stats page")):
            use(str(host), variables.get(name, VARIABLES[name].default), f"{what} ({name})")
    return problems


# --------------------------------------------------------------------------- rollouts


def rollout_problems(
    plan: Mapping[str, Mapping[str, Any]], variables: Mapping[str, Any], models: Sequence[Mapping[str, Any]] = ()
) -> list[str]:
    """The rollout batch and floor of each model's planned pools, resolved by the rollout's own
    code (rollout.resolve_pool): each model's pool on its own, with its entry's own values."""
    batch = {
        pool: variables.get(f"epd_rollout_batch_{pool}", VARIABLES[f"epd_rollout_batch_{pool}"].default)
        for pool in POOLS
    }
    floor = {pool: variables.get(f"epd_rollout_min_available_{pool}") for pool in POOLS}
    problems = []
    for (pool, model), size in pool_sizes(plan).items():
        try:
            resolve_pool(pool, model, size, batch, floor, models)
        except EpdPlanError as error:
            problems.append(str(error))
    return problems
