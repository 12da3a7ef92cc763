"""A fleet deployed by the release before issue 57 (main at PREVIOUS_RELEASE: router.yaml with the
one model at the top level and `endpoints.models.<name>`), re-deployed by this one (issue 57,
"Done when"): no engine task changes and no engine restarts (the engines keep their ids and
units: models[0] keeps no prefix), router.yaml is written once in the one-list shape, and the
router reloads at most once. The new kit itself rolls the router's processes once (roles/epd_deps
install.yml: a new kit restarts the router, which would run the old code); so a second re-deploy
starts from the old-shape file under the same kit and shows the shape change alone: one reload,
no process restarted. inventory/sandbox/two-models (two models, the router on n1). Lane b
(tests/e2e/conftest.py LANE_B)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.budget import scaled
from tests.e2e.conftest import DEPLOY, sandbox_inventory
from tests.e2e.stack import Stack, image_message, wait_for
from tests.hosts.harness import REPO, HostPool, ansible_playbook, playbook_command
from tests.hosts.sandbox import SandboxInventory
from tests.hosts.wheelhouse import PREVIOUS_CACHE, extract_previous_release

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1500)]

ENGINES = ("epd-engine@pd-0.service", "epd-engine@ve-0.service", "epd-engine@text-pd-0.service")
ROUTER = "epd-router@0.service"
ENGINE_FILES = "/etc/epd/engines /etc/systemd/system/epd-engine@.service"
CONFIG = "/etc/epd/router.yaml"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    """The tree of PREVIOUS_RELEASE (tests/hosts/wheelhouse.py built its wheelhouse before kithub)."""
    tree = tmp_path_factory.mktemp("previous-release") / "epd-kit"
    tree.mkdir()
    missing = extract_previous_release(tree)
    if missing:
        pytest.skip(missing)
    return tree


def deploy_with(tree: Path, inventory: Path) -> subprocess.CompletedProcess[str]:
    """deploy.yml of `tree`, from its root (its ansible.cfg: its collection), its planner on the
    controller (the filter plugin imports epd_kit.plan: PYTHONPATH puts that tree's first). Its
    kit's wheelhouse was built before kithub in a cache of its own (PREVIOUS_CACHE; inside the
    test namespace no index answers: docs/sandbox.md)."""
    cache = f"epd_deps_wheelhouse_cache={PREVIOUS_CACHE}"
    argv, env = playbook_command(inventory, DEPLOY, "-e", cache)
    argv[argv.index(str(REPO / DEPLOY))] = str(tree / DEPLOY)
    env["PYTHONPATH"] = str(tree / "router")
    return subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=scaled(900), check=False)


def changed_tasks(output: str, role: str) -> list[str]:
    """The tasks of `role` that reported `changed` in an ansible-playbook output."""
    changed, task = [], None
    for line in output.splitlines():
        header = re.match(r"(?:TASK|RUNNING HANDLER) \[(.+?)\]", line)
        if header:
            task = header.group(1)
        elif line.startswith("changed:") and task and f"{role} :" in task and task not in changed:
            changed.append(task)
    return changed


def since(host, epoch: str, unit: str, pattern: str) -> int:
    """How many journal lines of `unit` since `epoch` match `pattern` (grep -E)."""
    out = host.run(f"journalctl --no-pager -q -o cat -u '{unit}' --since @{epoch} | grep -cE '{pattern}'", check=False)
    return int(out.stdout.strip() or 0)


def snapshot(stack: Stack) -> dict[str, object]:
    host = stack.hosts["n1"]
    return {
        "engines": {unit: host.show(unit, "MainPID")["MainPID"] for unit in ENGINES},
        "files": host.run(f"find {ENGINE_FILES} -type f | sort | xargs sha256sum").stdout,
        "router": host.show(ROUTER, "MainPID")["MainPID"],
        "epoch": host.run("date +%s").stdout.strip(),
    }


def answers(stack: Stack) -> None:
    client = stack.openai()
    assert [m.id for m in client.models.list().data] == ["vision", "text"]
    vision = client.chat.completions.create(
        model="vision", messages=image_message("What is it?", (9, 9, 200)), max_tokens=4
    )
    text = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "Hi."}], max_tokens=4)
    assert vision.choices[0].message.content and text.choices[0].message.content


def test_a_fleet_of_the_release_before_redeploys_without_an_engine_restart_and_one_reload(
    host_pool: HostPool, previous_release: Path, record_timing, tmp_path_factory
):
    host_pool.require_model()
    inventory = SandboxInventory.load(sandbox_inventory("two-models", tmp_path_factory))
    # a bare kit: the previous release installs its own (a preinstalled one would be this one's)
    host_pool.up(1, kit=False)
    stack = Stack(inventory, {"n1": host_pool.host(1)})
    n1 = stack.hosts["n1"]
    first = deploy_with(previous_release, inventory.directory)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    stack.wait_ready(timeout=120)
    old_file = n1.run(f"cat {CONFIG}").stdout
    assert {"model", "endpoints"} <= set(yaml.safe_load(old_file)), "the previous release wrote the old shape"
    answers(stack)

    before = snapshot(stack)
    upgrade = ansible_playbook(inventory.directory, DEPLOY, timeout=900)
    assert upgrade.returncode == 0, upgrade.stdout[-4000:] + upgrade.stderr[-2000:]
    stack.wait_ready(timeout=60)
    after = snapshot(stack)
    assert changed_tasks(upgrade.stdout, "epd_engines") == [], "an engine task changed on the upgrade"
    assert (after["engines"], after["files"]) == (before["engines"], before["files"]), "an engine restarted"
    written = yaml.safe_load(n1.run(f"cat {CONFIG}").stdout)
    assert "model" not in written and [m["name"] for m in written["models"]] == ["vision", "text"]
    kit_changed = any("Install the kit" in task for task in changed_tasks(upgrade.stdout, "epd_deps"))
    starts = since(n1, str(before["epoch"]), ROUTER, "^Started ")
    reloads = since(n1, str(before["epoch"]), ROUTER, "config reloaded")
    print(f"upgrade: kit installed {kit_changed}, router process starts {starts}, reloads {reloads}")
    assert starts == (1 if kit_changed else 0), "the router's process rolled for more than the new kit"
    assert reloads <= 1
    answers(stack)

    # the shape change alone, under this kit: the old file back (the router loads it on a reload),
    # then this release's deploy writes the list: one reload, no process or engine restarted
    n1.run(f"cat > {CONFIG} <<'EOF'\n{old_file}EOF")
    again = snapshot(stack)
    n1.systemctl("reload", "epd-router.service")
    wait_for(lambda: since(n1, str(again["epoch"]), ROUTER, "config reloaded") == 1, timeout=30, what="the reload")
    assert since(n1, str(again["epoch"]), ROUTER, "config reload failed") == 0
    redeploy = ansible_playbook(inventory.directory, DEPLOY, timeout=900)
    assert redeploy.returncode == 0, redeploy.stdout[-4000:] + redeploy.stderr[-2000:]
    last = snapshot(stack)
    assert changed_tasks(redeploy.stdout, "epd_engines") == []
    assert (last["engines"], last["files"], last["router"]) == (again["engines"], again["files"], again["router"])
    assert since(n1, str(again["epoch"]), ROUTER, "^Started ") == 0
    assert since(n1, str(again["epoch"]), ROUTER, "config reloaded") == 2  # ours, then the deploy's one
    router_changes = changed_tasks(redeploy.stdout, "epd_router")
    assert any("Write the router configuration" in task for task in router_changes), router_changes
    assert not any("Roll the router processes" in task for task in router_changes), router_changes
    answers(stack)
