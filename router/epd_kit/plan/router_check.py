"""The router's settings checked on the controller by the router's own models.

`epd-router check-config` validates router.yaml on the router host with the pydantic models of
epd_kit/router_yaml.py (and preprocess/settings.py); the inventory check validates each
`epd_router_<section>` and `epd_router_extra_config` section with the same models, so one set of
rules (bounds, enumerations, cross-field validators) refuses a value before any host is contacted,
named by its inventory variable. The models live in epd_kit/router_yaml.py, a bottom module the
router imports too (never the router itself: tests/unit/test_import_graph.py), imported as this
package's sibling: the installed kit's, or the collection's own copy that the filters load on a
controller without the kit (plugins/filter/epd_kit.py), so both routes apply the same models.
They need pydantic (and PyYAML, which Ansible has): a controller whose Python lacks it checks the
keys' kinds only and says so once, naming the command that installs the collection's controller
requirements (`unavailable_reason`, `install_command`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from .variables import PLANNED_KEYS, VARIABLES

# The collection's controller-side Python requirements, declared as ansible-builder reads them
# (meta/execution-environment.yml names this file; docs.ansible.com/projects/builder
# "Collection-level dependencies"): present when this package is the collection's copy or a checkout.
CONTROLLER_REQUIREMENTS = Path(__file__).resolve().parents[3] / "meta" / "ee-requirements.txt"


@cache
def _load() -> tuple[dict[str, Any] | None, str]:
    """({section: its pydantic model} of router.yaml, "") or (None, why it cannot load)."""
    try:  # the bottom module of router.yaml's schema (no router runtime): pydantic is all it needs
        from ..router_yaml import RouterConfig
    except ImportError as error:
        return None, str(error)
    return {name: field.annotation for name, field in RouterConfig.model_fields.items()}, ""


def _models() -> dict[str, Any] | None:
    return _load()[0]


def available() -> bool:
    return _models() is not None


def unavailable_reason() -> str:
    """Why the router's models cannot load here (the ImportError's text), or "" when they can."""
    return _load()[1]


def install_command() -> str:
    """The command that gives this Python what the router's models need: the collection's
    requirements file where it is beside this package, else pydantic itself (pip's newest
    satisfies the kit's floor)."""
    python = sys.executable or "python3"
    if CONTROLLER_REQUIREMENTS.is_file():
        return f"{python} -m pip install -r {CONTROLLER_REQUIREMENTS}"
    return f"{python} -m pip install pydantic"


def section_default(section: str, key: str) -> Any:
    """The router's own default of `section.key` (None when the router package cannot load)."""
    models = _models()
    if models is None or section not in models:
        return None
    field = models[section].model_fields.get(key)
    return None if field is None else field.get_default(call_default_factory=True)


def router_section_problems(where: str, section: str, values: Mapping[str, Any]) -> list[str]:
    """One line per value the router's model of `section` refuses, named `where.key`."""
    models = _models()
    if models is None or section not in models or not values:
        return []
    from pydantic import ValidationError

    try:
        models[section].model_validate(dict(values))
    except ValidationError as error:
        problems = []
        for item in error.errors():
            key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"])
            message = item["msg"].removeprefix("Value error, ")
            shown = f"{where}{key} is {item['input']!r}" if key else where
            problems.append(
                f"{shown}: {message[0].lower()}{message[1:]} (the router's own rule, as epd-router check-config "
                "applies it); change the value in the inventory (docs/router.md lists the router's settings)"
            )
        return problems
    return []


# written from a variable but not its value (auth.enabled: true when a keys file is named)
DERIVED = frozenset({"auth.enabled"})


def planned_value_problems(values: Mapping[str, Any]) -> list[str]:
    """What the router's own models refuse in the router.yaml values the kit writes from one
    variable each (variables.PLANNED_KEYS: `tracing.otlp_traces_endpoint` from
    epd_otlp_traces_endpoint, ...), named by that variable: the router would refuse them only
    on its host, after deploy.yml changed the engines."""
    problems = []
    for path, variable in PLANNED_KEYS.items():
        section, _, key = path.partition(".")
        if not key or path in DERIVED or variable not in VARIABLES or values.get(variable) in (None, ""):
            continue
        for line in router_section_problems(variable, section, {key: values[variable]}):
            problems.append(line.replace(f"{variable}.{key} is ", f"{variable} is ", 1))
    return problems
