"""render.yml writes a set that can be checked as it is (issue 56): every router.yaml of the render of
every example and sandbox inventory passes `epd-router check-config` with the files it names read
from the render (the tenants and API keys files as placeholders, never a key of the inventory), and
every engine and router host has the access rules deploy would load, as the planner computes them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from epd_kit import plan as planner
from epd_kit.plan.tenants import PLACEHOLDER
from tests.ansible.helpers import BIN, INVENTORIES, INVENTORY_IDS, REPO, inventory_hostvars, playbook
from tests.budget import scaled

pytestmark = pytest.mark.ansible

# router.yaml's keys that name a file check-config reads (epd_kit/router/cli.py check_config)
READ_FILES = ("api_keys_file", "tenants_file")
KEYS = [
    {"tenant": "acme", "key": "sk-acme-3f9c1b2e7d4a60c8"},
    {"tenant": "beta", "key": "sk-beta-0b7e5d2c9a4f1836"},
]


def check_config(out: Path, router: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """check-config on the host's rendered router.yaml, the files it names taken from the render:
    the same file, its absolute paths moved under RENDER_DIR/<host> (where render wrote them)."""
    config = yaml.safe_load((out / router / "etc/epd/router.yaml").read_text())
    for key in READ_FILES:
        named = (config.get("auth") or {}).get(key)
        if named:
            rendered = out / router / named.lstrip("/")
            assert rendered.is_file(), f"{router}: router.yaml names {named}, which render.yml did not write"
            config["auth"][key] = str(rendered)
    moved = tmp_path / f"{router}-router.yaml"
    moved.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run(
        [str(BIN / "epd-router"), "check-config", str(moved)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_every_rendered_router_config_passes_check_config_and_every_host_has_its_rules(inventory, rendered, tmp_path):
    out = rendered(inventory)
    hostvars, groups = inventory_hostvars(inventory)
    for router in groups["epd_router"]:
        check = check_config(out, router, tmp_path)
        assert check.returncode == 0 and check.stdout.startswith("OK "), check.stdout + check.stderr
    plan = planner.plan_from_hostvars(hostvars, groups["epd_engines"])
    port = planner.fleet_settings(hostvars, groups["epd_engines"]).router_port
    for host in dict.fromkeys([*groups["epd_engines"], *groups["epd_router"]]):
        expected = planner.firewall.firewall_for(plan, port, hostvars, groups, host)
        rules = out / host / "etc/nftables.d/epd-kit.nft"
        assert rules.is_file() == expected["enabled"], host
        if expected["enabled"]:
            assert expected["nft"] in rules.read_text()


def test_a_fleet_with_tenants_and_api_keys_renders_checkable_placeholders_never_its_keys(tmp_path):
    inventory = REPO / "inventory/sandbox/one-host"
    extra = tmp_path / "auth.yml"
    extra.write_text(
        yaml.safe_dump(
            {
                "epd_router_tenants": {"acme": {"tokens_per_min": 200000}, "beta": None},
                "epd_router_tenant_keys": KEYS,
                "epd_router_api_keys_file": "/etc/epd/api-keys",
            }
        )
    )
    out = tmp_path / "render"
    result = playbook("-i", str(inventory), "playbooks/render.yml", "-e", f"render_dir={out}", "-e", f"@{extra}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    _, groups = inventory_hostvars(inventory)
    for router in groups["epd_router"]:
        config = yaml.safe_load((out / router / "etc/epd/router.yaml").read_text())
        assert config["auth"]["tenants_file"] == "/etc/epd/tenants"
        assert config["auth"]["api_keys_file"] == "/etc/epd/api-keys"
        check = check_config(out, router, tmp_path)
        assert check.returncode == 0, check.stdout + check.stderr
        tenants = out / router / "etc/epd/tenants"
        api_keys = out / router / "etc/epd/api-keys"
        # the router's modes: 0640 for the tenants file, 0600 for the API keys (router/auth.py)
        assert (tenants.stat().st_mode & 0o777, api_keys.stat().st_mode & 0o777) == (0o640, 0o600)
        for path in (tenants, api_keys):
            text = path.read_text()
            assert text.startswith("# PLACEHOLDER written by render.yml") and PLACEHOLDER in text
        parsed = planner_tenants(tenants.read_text())
        assert parsed.owners == ("acme", "beta") and all(key.startswith(PLACEHOLDER.encode()) for key in parsed.keys)
    for path in out.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not any(entry["key"] in text for entry in KEYS), f"{path} holds a key of the inventory"


def planner_tenants(text: str):
    from epd_kit.plan.tenants_format import parse_tenants

    return parse_tenants(text, "rendered tenants")
