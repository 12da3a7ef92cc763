"""The repository as the collection epd.kit: build it, install it elsewhere, run it by FQCN.

docs/operations.md's build/install/run lines run exactly as written, typed in the repository
(whose ansible.cfg finds the repository itself as epd.kit). The installed copy runs from an
unrelated directory on a controller whose Python cannot import the kit (an empty `epd_kit`
shadows it), so the filters use the collection's bundled epd_kit.plan; its render must equal
the in-repo render byte for byte.
"""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import BIN, REPO
from tests.budget import scaled

pytestmark = pytest.mark.ansible

INVENTORIES = [REPO / "inventory/examples/single-node-1e1pd", REPO / "inventory/sandbox/one-host"]


OPERATIONS = REPO / "docs/operations.md"


def galaxy() -> dict:
    return yaml.safe_load((REPO / "galaxy.yml").read_text())


def test_galaxy_version_is_the_packages():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert galaxy()["version"] == project["version"]
    assert (galaxy()["namespace"], galaxy()["name"]) == ("epd", "kit")


def test_the_controller_requirements_are_the_packages_floors():
    """meta/ee-requirements.txt (named by meta/execution-environment.yml, where ansible-builder
    looks) lists pydantic and PyYAML with pyproject.toml's floors: floors only, as Ansible's
    collection requirements ask (no cap, no pin)."""
    declared = yaml.safe_load((REPO / "meta/execution-environment.yml").read_text())
    assert declared["dependencies"] == {"python": "meta/ee-requirements.txt"}
    lines = (REPO / declared["dependencies"]["python"]).read_text().splitlines()
    wanted = [line for line in lines if line.strip() and not line.startswith("#")]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower(): d for d in dependencies}
    assert wanted == [floors["pydantic"], floors["pyyaml"]]
    assert all(">=" in line and "<" not in line and "==" not in line for line in wanted), wanted


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(collections path, a clean environment, an unrelated working directory) of the installed artifact."""
    root = tmp_path_factory.mktemp("collection")
    shadow = root / "shadow/epd_kit"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('"""Not the kit: stands in for a controller without epd-kit installed."""\n')
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env.update(
        {
            "ANSIBLE_COLLECTIONS_PATH": str(root / "collections"),
            "ANSIBLE_LOCAL_TEMP": str(root / "ansible-tmp"),
            "ANSIBLE_HOME": str(root / "ansible-home"),
            "ANSIBLE_NOCOLOR": "1",
            "PYTHONPATH": str(shadow.parent),
            "PATH": f"{BIN}:{env.get('PATH', '')}",
        }
    )
    env.pop("HF_TOKEN", None)

    def run(*argv: str, cwd: Path = elsewhere) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(600), check=False)

    built = run(str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(root / "dist"), str(REPO))
    assert built.returncode == 0, built.stdout + built.stderr
    artifact = root / "dist" / f"epd-kit-{galaxy()['version']}.tar.gz"
    assert artifact.is_file(), built.stdout
    done = run(str(BIN / "ansible-galaxy"), "collection", "install", str(artifact), "-p", str(root / "collections"))
    assert done.returncode == 0, done.stdout + done.stderr
    home = root / "collections/ansible_collections/epd/kit"
    assert (home / "router/epd_kit/plan/command.py").is_file() and (home / "templates/epd-engine@.service.j2").is_file()
    assert (home / "meta/execution-environment.yml").is_file() and (home / "meta/ee-requirements.txt").is_file()
    assert not (home / ".collections").exists(), "the in-repo collection link must not be packed"
    return run, root


def test_installed_plan_runs_by_fqcn_from_anywhere(installed):
    run, _ = installed
    result = run(str(BIN / "ansible-playbook"), "epd.kit.plan", "-i", str(INVENTORIES[0]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "trn2-node1  pd-0    pd tp8  0-7    18100" in result.stdout
    assert "ve-0    ve tp4  8-11   18300  14600-14603   epd-ve-0" in result.stdout


@pytest.mark.parametrize("inventory", INVENTORIES, ids=[p.name for p in INVENTORIES])
def test_installed_render_equals_the_in_repo_render(installed, rendered, inventory):
    run, root = installed
    out = root / f"render-{inventory.name}"
    result = run(str(BIN / "ansible-playbook"), "epd.kit.render", "-i", str(inventory), "-e", f"render_dir={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert_same_tree(rendered(inventory), out)


def assert_same_tree(expected: Path, actual: Path) -> None:
    files = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(actual) for p in actual.rglob("*") if p.is_file())
    assert files, f"nothing rendered in {expected}"
    _, mismatch, errors = filecmp.cmpfiles(expected, actual, [str(f) for f in files], shallow=False)
    assert not mismatch and not errors, f"differ: {mismatch + errors}"


def documented_sequence() -> list[str]:
    """The commands of docs/operations.md's block that builds the collection, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", OPERATIONS.read_text(), flags=re.DOTALL)
    block = next(b for b in blocks if "ansible-galaxy collection build" in b)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_documented_sequence_installs_and_runs_when_typed_in_the_repository(tmp_path):
    """Build, install, run: typed in the repository as written (only the inventory placeholder
    filled in), with a fresh home whose ~/.ansible/collections receives the collection; the run
    line then works in the repository (the working tree) and in any other directory (the
    installed copy)."""
    build, install, play = documented_sequence()
    version = galaxy()["version"]
    assert f"epd-kit-{version}.tar.gz" in install, f"docs/operations.md installs another version than {version}"
    home = tmp_path / "home"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env.update({"HOME": str(home), "ANSIBLE_NOCOLOR": "1", "PATH": f"{BIN}:{env.get('PATH', '')}"})
    env.pop("HF_TOKEN", None)
    play = play.replace("/abs/path/to/INVENTORY", str(INVENTORIES[0]))
    artifact = REPO / "dist" / f"epd-kit-{version}.tar.gz"

    def typed(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(600), check=False
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        return done

    try:
        typed(build, REPO)
        installed = typed(install, REPO)
    finally:
        artifact.unlink(missing_ok=True)
    assert "Nothing to do" not in installed.stdout, installed.stdout
    manifest = home / ".ansible/collections/ansible_collections/epd/kit/MANIFEST.json"
    assert manifest.is_file(), installed.stdout
    assert "[WARNING]" not in installed.stderr, installed.stderr
    for cwd in (REPO, elsewhere):
        result = typed(play, cwd)
        assert "ve-0    ve tp4  8-11   18300  14600-14603   epd-ve-0" in result.stdout, result.stdout[-3000:]
    listed = typed("ansible-galaxy collection list epd.kit", elsewhere).stdout
    assert str(manifest.parent.parent.parent) in listed and str(REPO) not in listed, listed
