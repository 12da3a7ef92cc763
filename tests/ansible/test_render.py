"""render.yml on every example and sandbox inventory: files, argv/env, router config, systemd-analyze."""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from epd_kit import plan as planner
from epd_kit.plan.checks import text_only
from tests.ansible.helpers import BIN, INVENTORIES, INVENTORY_IDS, REPO, inventory_hostvars, playbook
from tests.ansible.systemd_expand import expand_specifiers, parse_unit, service_command
from tests.budget import scaled

pytestmark = pytest.mark.ansible

SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
HOST_UNIT_DIRS = [Path("/lib/systemd/system"), Path("/usr/lib/systemd/system")]


@functools.cache
def resolved(inventory: Path) -> tuple[dict, dict[str, list[str]]]:
    return inventory_hostvars(inventory)


def planned(inventory: Path) -> tuple[dict, dict[str, list[str]]]:
    hostvars, groups = resolved(inventory)
    return planner.plan_from_hostvars(hostvars, groups["epd_engines"]), groups


def engine_files(host_dir: Path, instance: str) -> tuple[str, dict[str, str], dict]:
    unit = (host_dir / "etc/systemd/system/epd-engine@.service").read_text()
    env_path = f"/etc/epd/engines/{instance}.env"
    env_files = {env_path: (host_dir / env_path.lstrip("/")).read_text()}
    record = json.loads((host_dir / f"engines/{instance}.json").read_text())
    return unit, env_files, record


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_render_writes_every_planned_file(inventory, rendered):
    out = rendered(inventory)
    plan, groups = planned(inventory)
    for host, host_plan in plan.items():
        host_dir = out / host
        assert (host_dir / "etc/systemd/system/epd-engine@.service").is_file()
        assert (host_dir / "etc/systemd/system/epd-engines.target").is_file()
        assert (host_dir / "etc/systemd/system/epd.target").is_file()
        instances = sorted(e["instance"] for e in host_plan["engines"])
        assert sorted(p.stem for p in (host_dir / "etc/epd/engines").glob("*.env")) == instances
        assert sorted(p.stem for p in (host_dir / "engines").glob("*.json")) == instances
    for router in groups["epd_router"]:
        assert (out / router / "etc/epd/router.yaml").is_file()
        assert (out / router / "etc/systemd/system/epd-router.service").is_file()
    for path in out.rglob("*"):
        if path.is_file() and path.suffix != ".json":
            text = path.read_text()
            if path.suffix == ".nft":  # the access rules: nft's shebang first, as deploy writes them
                shebang, _, text = text.partition("\n#\n")
                assert shebang.startswith("#!") and shebang.endswith("nft -f"), f"{path} lacks nft's shebang"
            assert text.startswith("# Ansible managed"), f"{path} lacks the ansible_managed header"


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_unit_plus_env_file_run_exactly_the_planned_argv(inventory, rendered):
    """Expanding ExecStart with the env file as systemd does gives the planner's argv and env."""
    out = rendered(inventory)
    plan, _ = planned(inventory)
    checked = 0
    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            unit, env_files, record = engine_files(out / host, engine["instance"])
            unit_name = f"epd-engine@{engine['instance']}.service"
            argv, environment = service_command(unit, unit_name, env_files)
            assert argv == record["argv"], f"{host} {unit_name}: unit expands to a different argv than the render JSON"
            assert argv[1:] == [str(t) for t in engine["argv"][1:]], f"{host} {unit_name}: not the planner's argv"
            assert Path(argv[0]).is_absolute() and Path(argv[0]).name == engine["argv"][0]
            assert environment == record["environment"]
            for name, value in engine["env"].items():
                assert environment[name] == value
            if engine["argv"][0] != planner.BACKEND_EXECUTABLES["vllm-cpu"]:  # no EFA on a CPU engine
                assert environment["FI_EFA_ENABLE_SHM_TRANSFER"] == "0" and environment["FI_EFA_USE_DEVICE_RDMA"] == "1"
            checked += 1
    assert checked == sum(len(p["engines"]) for p in plan.values()) > 0


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_readiness_gate_and_stagger_match_the_plan(inventory, rendered):
    out = rendered(inventory)
    plan, _ = planned(inventory)
    for host, host_plan in plan.items():
        unit = parse_unit((out / host / "etc/systemd/system/epd-engine@.service").read_text())
        timeout = int(unit.values("Service", "TimeoutStartSec")[0])
        assert unit.values("Service", "LimitMEMLOCK") == ["infinity"]
        # a dead vLLM engine core's API server exits 0: on-failure would not restart it
        assert unit.values("Service", "Restart") == ["always"]
        assert not unit.values("Service", "PrivateDevices"), "PrivateDevices would hide /dev/neuron*"
        for engine in host_plan["engines"]:
            unit_text, env_files, _ = engine_files(out / host, engine["instance"])
            _, environment = service_command(unit_text, f"epd-engine@{engine['instance']}.service", env_files)
            assert environment["EPD_START_DELAY_S"] == str(engine["start_delay_s"])
            assert environment["EPD_HEALTH_URL"].endswith(f":{engine['port']}/health")
            ready = int(environment["EPD_READY_TIMEOUT_S"])
            assert ready > 0 and ready + engine["start_delay_s"] < timeout, (
                "healthwait must give up before systemd's timeout"
            )


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_router_config_lists_every_engine_of_every_host(inventory, rendered):
    out = rendered(inventory)
    plan, groups = planned(inventory)
    hostvars = resolved(inventory)[0]
    settings = planner.fleet_settings(hostvars, groups["epd_engines"])
    # every model of the fleet, epd_model's first (its pools text-only when the fleet is, said
    # outright from the plan), each epd_models entry's after it (inventory/sandbox/two-models)
    fleet = planner.models.fleet_models(settings, text_only(hostvars, groups["epd_engines"]))
    expected = [
        {**({"text_only": True} if m.text_only else {}), **planner.router_endpoints(plan, (), m.key)} for m in fleet
    ]
    assert all(endpoints["pd"] for endpoints in expected)
    for router in groups["epd_router"]:
        config_path = out / router / "etc/epd/router.yaml"
        config = yaml.safe_load(config_path.read_text())
        assert [m["endpoints"] for m in config["models"]] == expected
        assert all(
            e["state"] == "active" for m in config["models"] for role in ("ve", "pd") for e in m["endpoints"][role]
        )
        assert [m["model"] for m in config["models"]] == [m.settings.model for m in fleet]
        served = hostvars[router].get("epd_router_served_model_name") or settings.model
        assert [m["name"] for m in config["models"]] == [served, *(m.name for m in fleet[1:])]
        for entry, spec in zip(config["models"], fleet, strict=True):
            assert entry["limits"]["max_image_patches"] == spec.settings.vision_attention_block_size
            assert entry["limits"]["images_per_prompt"] == spec.settings.images_per_prompt
        assert config["listen"]["port"] == settings.router_port
        check = subprocess.run(
            [str(BIN / "epd-router"), "check-config", str(config_path)],
            capture_output=True,
            text=True,
            timeout=scaled(120),
            check=False,
        )
        assert check.returncode == 0, f"epd-router check-config rejected {config_path}: {check.stdout}{check.stderr}"


def _stub(root: Path, path: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.write_text("#!/bin/sh\nexit 0\n")
        target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def verify_rendered_host(rendered_host: Path, instances: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify a rendered host's units in a temp root that holds systemd's own
    units and a stub at every command path our units run."""
    system_units = next((d for d in HOST_UNIT_DIRS if (d / "sysinit.target").exists()), None)
    assert system_units is not None, "systemd's own units (sysinit.target) not found on this machine"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    unit_dir = root / "etc/systemd/system"
    shutil.copytree(rendered_host / "etc/systemd/system", unit_dir)
    names = sorted(p.name for p in unit_dir.iterdir() if p.name != "epd-engine@.service")
    for instance in instances:  # a template is verified through its instances
        os.symlink("epd-engine@.service", unit_dir / f"epd-engine@{instance}.service")
        names.append(f"epd-engine@{instance}.service")
    for unit_file in unit_dir.iterdir():
        if unit_file.is_symlink():
            continue
        unit = parse_unit(unit_file.read_text())
        for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost"):
            for command in unit.values("Service", key):
                _stub(root, expand_specifiers(command, "x@y.service").lstrip("-@+!:").split()[0])
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", f"--root={root}", *names],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=False,
    )


@pytest.mark.parametrize("inventory", INVENTORIES, ids=INVENTORY_IDS)
def test_systemd_analyze_verify_every_rendered_unit(inventory, rendered, tmp_path):
    """Any output at all (even a warning with rc 0) fails."""
    if not Path(SYSTEMD_ANALYZE).exists():
        pytest.fail("systemd-analyze not found: install systemd (tier 2 needs it)")
    out = rendered(inventory)
    plan, groups = planned(inventory)
    for host in sorted(set(plan) | set(groups["epd_router"])):
        instances = [e["instance"] for e in plan.get(host, {}).get("engines", [])]
        result = verify_rendered_host(out / host, instances, tmp_path / host)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
            f"{host}: systemd-analyze verify:\n{result.stdout}{result.stderr}"
        )


def test_systemd_analyze_harness_catches_a_warning(rendered, tmp_path):
    """Negative control: the same harness reports a typo that systemd only warns about (rc 0)."""
    inventory = next(i for i in INVENTORIES if i.name == "single-node-1e1pd")
    broken = tmp_path / "broken"
    shutil.copytree(rendered(inventory) / "trn2-node1", broken)
    unit = broken / "etc/systemd/system/epd-router@.service"
    unit.write_text(unit.read_text().replace("Restart=always", "Restart=sometimes"))
    result = verify_rendered_host(broken, ["pd-0"], tmp_path / "root")
    assert "Failed to parse service restart specifier" in result.stdout + result.stderr


TRACES_URL = "http://10.213.0.1:4318/v1/traces"


@pytest.fixture(scope="module")
def one_host_from_the_command_line(tmp_path_factory) -> Path:
    """one-host rendered with two settings given by -e (each test below reads its own; one render
    instead of two: a render is ~2.5 CPU-s): a router process count and a traces collector."""
    out = tmp_path_factory.mktemp("render-extra-vars")
    result = playbook(
        "-i", str(REPO / "inventory/sandbox/one-host"), "playbooks/render.yml", "-e", f"render_dir={out}",
        "-e", "epd_router_workers=3", "-e", f"epd_otlp_traces_endpoint={TRACES_URL}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return out


def test_a_count_given_on_the_command_line_renders_like_the_same_count_in_the_inventory(
    one_host_from_the_command_line,
):
    """`-e epd_router_workers=3` reaches the roles as the string "3" (the planner accepts digits for
    an integer, docs/planner.md): the router units must still list processes 0..2, where the
    template once failed with "unsupported operand type(s) for -"."""
    tmp_path = one_host_from_the_command_line
    unit = (tmp_path / "n1/etc/systemd/system/epd-router.service").read_text()
    assert "(epd-router@0..2)" in unit, unit
    wants = next(line for line in unit.splitlines() if line.startswith("Wants="))
    assert wants.split("=", 1)[1].split()[:3] == [f"epd-router@{n}.service" for n in range(3)], wants


def test_a_named_traces_collector_reaches_the_router_config_and_every_engine_unit(
    one_host_from_the_command_line, rendered
):
    """epd_otlp_traces_endpoint: router.yaml's tracing and each engine's env file (its argv's role
    arguments and the exporter protocol), as the plan says (docs/observability.md "Traces")."""
    tmp_path, url = one_host_from_the_command_line, TRACES_URL
    plain = yaml.safe_load((rendered(REPO / "inventory/sandbox/one-host") / "n1/etc/epd/router.yaml").read_text())
    assert "tracing" not in plain, plain  # the inventory names no collector: the -e alone set it
    router = yaml.safe_load((tmp_path / "n1/etc/epd/router.yaml").read_text())
    assert router["tracing"] == {"otlp_traces_endpoint": url}
    env_files = sorted((tmp_path / "n1/etc/epd/engines").glob("*.env"))
    assert env_files
    for env_file in env_files:
        text = env_file.read_text()
        assert f"--otlp-traces-endpoint {url}" in text, env_file.name
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/protobuf'" in text, env_file.name


def test_a_rollouts_draining_write_changes_only_the_endpoints_of_the_file_the_host_has(tmp_path, rendered):
    """The router role with epd_router_endpoints_only (rolling_batch.yml, rolling_activate.yml,
    drain_retiring.yml set it) renders the host's router.yaml (epd_router_current, as config.yml
    reads it) with the plan's endpoints alone: a model the inventory adds (`two`) stays out of
    `models` and of the endpoints, for the router play to roll in (docs/operations.md "Several models")."""
    two_models = REPO / "inventory/sandbox/two-models"
    running = (rendered(two_models) / "n1/etc/epd/router.yaml").read_text()
    inventory = shutil.copytree(two_models, tmp_path / "inventory")  # the links' targets copied
    models = inventory / "group_vars/all/models.yml"
    doc = yaml.safe_load(models.read_text())
    doc["epd_models"].append({"name": "two", "model": "/models/tiny-qwen3-vl", "text_only": True, "pd_tp": 4})
    models.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    play = {
        "hosts": "epd_router",
        "connection": "local",
        "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "epd_hf_token": ""},
        "tasks": [
            {"ansible.builtin.include_role": {"name": "epd.kit.epd_common", "tasks_from": "plan"}, "run_once": True},
            {"ansible.builtin.set_fact": {"epd_router_current": {"files": {"/etc/epd/router.yaml": running}}}},
            {
                "ansible.builtin.include_role": {"name": "epd.kit.epd_router", "tasks_from": "render"},
                "vars": {
                    "epd_render_hosts": ["{{ inventory_hostname }}"],
                    "epd_render_root": str(out / "{{ inventory_hostname }}"),
                    "epd_router_endpoints_only": True,
                },
            },
        ],
    }
    book = tmp_path / "play.yml"
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    result = playbook("-i", str(inventory), str(book))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    written = yaml.safe_load((out / "n1/etc/epd/router.yaml").read_text())
    before = yaml.safe_load(running)
    assert [m["name"] for m in written["models"]] == ["vision", "text"]
    assert written == before  # no engine draining: the plan's lists, as running, and nothing else
    full = playbook("-i", str(inventory), "playbooks/render.yml", "-e", f"render_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-2000:]
    rendered_full = yaml.safe_load((tmp_path / "full/n1/etc/epd/router.yaml").read_text())
    assert [m["name"] for m in rendered_full["models"]] == ["vision", "text", "two"]  # what the router play writes


@pytest.mark.parametrize("name", ["one-host", "text-only", "two-models"])
def test_a_router_yaml_of_the_release_before_is_rewritten_as_the_list_with_a_reload_alone(name, rendered):
    """The router.yaml main rendered at f3f3a81 (tests/golden/router-yaml-f3f3a81, the old shape)
    and this release's render of the same sandbox inventory: the same models with the same pools,
    and the same view of what the processes read at start (restart_view: the router play rolls
    them only when it differs, roles/epd_router/tasks/configure.yml), so re-deploying a fleet of
    the release before reloads its router (the file changed) and rolls nothing."""
    from epd_kit.plan.router_shape import models_as_list, restart_view

    old = yaml.safe_load((REPO / "tests/golden/router-yaml-f3f3a81" / f"{name}.yaml").read_text())
    new = yaml.safe_load((rendered(REPO / "inventory/sandbox" / name) / "n1/etc/epd/router.yaml").read_text())
    assert "model" in old and "model" not in new and new != old
    assert restart_view(new) == restart_view(old)
    assert [(m["name"], m["endpoints"]) for m in new["models"]] == [
        (m["name"], m["endpoints"]) for m in models_as_list(old)[0]["models"]
    ]
