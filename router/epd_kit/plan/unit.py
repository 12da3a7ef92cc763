"""The engine's systemd unit: its ExecStart line and its env file, derived from the command model.

`epd-engine@.service` runs `exec_start(executable)`, a fixed line that names SERVE_LINE's
variables; `/etc/epd/engines/<instance>.env` gives them this engine's values
(`engine_unit(...)["env_file"]`). Expanding one with the other is the planner's argv.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .command import SERVE_LINE
from .errors import EpdPlanError
from .net import probe_url

# ExecStartPost gives up this long before systemd's TimeoutStartSec (at least 30 s of budget).
READY_TIMEOUT_MARGIN_S = 15
MIN_READY_TIMEOUT_S = 30


def exec_start(executable: str) -> str:
    """The unit's ExecStart= value: `<executable> serve` and SERVE_LINE, one piece per line."""
    return f"{executable} serve " + " \\\n    ".join(piece.unit_text for piece in SERVE_LINE)


def engine_unit(engine: Mapping[str, Any], executable: str, start_timeout_s: int) -> dict[str, Any]:
    """{argv, env_file} of one planned engine's unit.

    argv is what the unit runs (the planner's argv with the absolute executable); env_file is
    every assignment of its env file, in file order: the process environment, the command's
    unit variables, then the unit's plumbing (stagger, readiness URL and its time budget, which
    leaves the stagger and a margin to systemd's TimeoutStartSec=start_timeout_s).
    """
    delay = int(engine.get("start_delay_s") or 0)
    env_file = {str(name): str(value) for name, value in sorted(dict(engine.get("env") or {}).items())}
    env_file.update(engine["unit_variables"])
    env_file.update(
        {
            "EPD_START_DELAY_S": str(delay),
            "EPD_HEALTH_URL": probe_url(engine.get("host") or "127.0.0.1", engine["port"]) + "/health",
            "EPD_READY_TIMEOUT_S": str(max(int(start_timeout_s) - delay - READY_TIMEOUT_MARGIN_S, MIN_READY_TIMEOUT_S)),
        }
    )
    for name, value in env_file.items():
        if "\n" in value or "\r" in value:
            raise EpdPlanError(
                f"engine {engine.get('engine_id', '?')}: {name} contains a line break, "
                "which an EnvironmentFile cannot hold"
            )
    return {"argv": [executable, *map(str, engine["argv"][1:])], "env_file": env_file}


def read_env_file(text: str) -> dict[str, str]:
    """The assignments of an env file as templates/epd-engine.env.j2 writes it ('...' or "..." values)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if not sep or line.startswith(("#", ";")):
            continue
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = "".join(_unescape(value[1:-1]))
        out[name.strip()] = value
    return out


def _unescape(text: str):
    chars = iter(text)
    for char in chars:
        yield next(chars, "") if char == "\\" else char
