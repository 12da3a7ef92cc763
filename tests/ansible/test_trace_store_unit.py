"""The trace store's unit (roles/epd_observability templates/epd-trace-store.service.j2), rendered by
Ansible's template module with the role's own vars: Phoenix's settings (phoenix/config.py of
arize-phoenix 20.26.1), the store's address and ports from the planner (plan/trace_store.py), and
the hardening of the kit's router unit."""

from __future__ import annotations

import re

import pytest
import yaml

from epd_kit.plan import trace_store
from tests.ansible.helpers import REPO, local_play

pytestmark = pytest.mark.ansible

ROLE = REPO / "roles/epd_observability"
ROUTER_UNIT = REPO / "templates/epd-router@.service.j2"


def directives(text: str) -> list[tuple[str, str]]:
    return [tuple(line.split("=", 1)) for line in text.splitlines() if re.match(r"^[A-Za-z]+=", line)]


@pytest.fixture(scope="module")
def unit(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("trace-store-unit")
    hostvars = {"mon1": {"epd_bind_address": "10.0.0.9", "epd_trace_store": "phoenix", "epd_trace_store_port": 16006}}
    store = trace_store.trace_store(hostvars, {"epd_monitoring": ["mon1"]})
    role_vars = yaml.safe_load((ROLE / "vars/main.yml").read_text())
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    names = [k for k in role_vars if k.startswith("epd_observability_trace_store_") and "{{" not in str(role_vars[k])]
    variables = {k: role_vars[k] for k in names} | {
        k: v for k, v in defaults.items() if k.startswith("epd_trace_store")
    }
    variables |= {
        "epd_trace_store_port": 16006,
        "epd_observability_trace_store_plan": {"address": store.address, "url": store.url}
        | {"traces_endpoint": store.traces_endpoint},
    }
    dest = tmp / "epd-trace-store.service"
    task = {
        "name": "Render the unit",
        "ansible.builtin.template": {"src": str(ROLE / "templates/epd-trace-store.service.j2"), "dest": str(dest)},
        "vars": variables,
    }
    local_play(tmp, [task], [])
    return dest.read_text()


def test_phoenix_binds_the_store_address_and_keeps_its_data_in_the_storage_dir(unit):
    env = dict(value.split("=", 1) for key, value in directives(unit) if key == "Environment")
    assert env["PHOENIX_HOST"] == "10.0.0.9" and env["PHOENIX_PORT"] == "16006"
    assert env["PHOENIX_GRPC_PORT"] == "4317"
    assert env["PHOENIX_WORKING_DIR"] == "/var/lib/epd-phoenix"
    assert env["PHOENIX_SQL_DATABASE_URL"] == "sqlite:////var/lib/epd-phoenix/phoenix.db"
    assert env["PHOENIX_DEFAULT_RETENTION_POLICY_DAYS"] == "7"
    assert env["PHOENIX_ALLOW_EXTERNAL_RESOURCES"] == "false" and env["PHOENIX_TELEMETRY_ENABLED"] == "false"
    assert "OTLP/HTTP ingest at http://10.0.0.9:16006/v1/traces" in unit
    pairs = dict(directives(unit))
    assert pairs["ExecStart"] == "/opt/epd/phoenix/bin/phoenix serve"
    assert pairs["User"] == pairs["Group"] == "epd-phoenix"
    assert pairs["ReadWritePaths"] == "/var/lib/epd-phoenix"


def test_hardened_like_the_router(unit):
    """Every hardening directive of the router's unit, with the router's value, except
    MemoryDenyWriteExecute (not verified with Phoenix's native wheels, said in the unit) and the
    router's own paths."""
    mine = set(directives(unit))
    skip = {"MemoryDenyWriteExecute", "ReadWritePaths", "ProtectHome"}
    hardening = re.compile(
        r"^(Protect|Private|Restrict|NoNewPrivileges|Capability|Ambient|SystemCall|Lock|Memory|Remove)"
    )
    router = [d for d in directives(ROUTER_UNIT.read_text()) if hardening.match(d[0]) and d[0] not in skip]
    assert len(router) >= 20
    assert [d for d in router if d not in mine] == []
    assert ("ProtectHome", "true") in mine and ("UMask", "0077") in mine
